"""Save a ZeRO training state: every rank writes its own fragments, rank 0 seals the tag.

What each rank writes (layout and atomicity: ``layout.py``, Note [atomic checkpoint]):

- ``weights.rankR-of-N.pt``: the fp32 master values of the fragments it owns (4 bytes per element;
  summed over ranks: 4Ψ for stages 1-3, and also 4Ψ for stage 0, whose replicated fragments are
  written by the lowest rank holding them only, see `_owned_pieces`);
- ``optim.rankR-of-N.pt``: the inner optimizer's per-element state for the same pieces (Adam:
  8 bytes per element) and the rank's RNG states;
- rank 0 also writes ``common.pt`` (hyper-parameters, the scalar state of each parameter such as
  Adam's ``step``, loss scaler, step counters, model buffers) and, last, ``metadata.json``
  (with node-local storage, the lowest rank of each storage does: storage.py).

Two halves: `snapshot` (collective) copies all of it into host memory and unseals the tag;
`PendingSave` (pending.py, local) writes the files and seals. `save_checkpoint` runs both on
the caller's thread; an asynchronous saver runs the second on a background thread.

Host memory while saving: one copy of this rank's fragments and of their optimizer state, i.e.
(4 + K_state)·Ψ/N bytes for the partitioned stages (pieces are packed into one new tensor per file,
so ``torch.save`` never writes the whole flat storage a slice views).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator
from minispeed.zero.checkpoints.agree import together
from minispeed.zero.checkpoints.layout import (
    DONE_GLOB,
    FORMAT_VERSION,
    METADATA_FILE,
    CheckpointMetadata,
    ParamRecord,
    pack_pieces,
)
from minispeed.zero.checkpoints.model16 import (
    MODEL_16BIT_FILE,
    gather_16bit_state_dict,
    gather_full,
)
from minispeed.zero.checkpoints.pending import PendingSave
from minispeed.zero.checkpoints.storage import StorageGroups, probe_storage

__all__ = ["save_checkpoint", "snapshot"]


def _owned_pieces(
    all_fragments: list[list[tuple[str, int, int]]], rank: int, peers: tuple[int, ...]
) -> list[tuple[str, int, int]]:
    """This rank's (name, start, numel) ranges that no lower rank of `peers` also holds.

    Stage 0 replicates every parameter, so without this every rank would write Ψ·4 bytes; with
    it rank 0 writes them once. Partitioned stages hold disjoint ranges and keep all of theirs.
    `peers` are the ranks sharing this rank's directory (all, unless node-local): each storage
    holds every piece its ranks need.
    """
    covered: dict[str, list[tuple[int, int]]] = {}
    for lower in (all_fragments[r] for r in peers if r < rank):
        for name, start, numel in lower:
            covered.setdefault(name, []).append((start, start + numel))
    owned = []
    for name, start, numel in all_fragments[rank]:
        todo = [(start, start + numel)]
        for a, z in sorted(covered.get(name, [])):
            todo = [piece for lo, hi in todo for piece in _subtract(lo, hi, a, z)]
        owned.extend((name, lo, hi - lo) for lo, hi in todo if hi > lo)
    return owned


def _subtract(lo: int, hi: int, a: int, z: int) -> Iterable[tuple[int, int]]:
    """[lo, hi) minus [a, z): up to two ranges."""
    if z <= lo or a >= hi:
        return [(lo, hi)]
    return [r for r in ((lo, a), (z, hi)) if r[1] > r[0]]


def _rng_state() -> dict[str, Any]:
    acc = get_accelerator()
    state: dict[str, Any] = {
        "cpu": torch.get_rng_state(),
        "accelerator_name": acc.name,
        "accelerator": None,
    }
    if acc.name != "cpu":
        module = torch.get_device_module(acc.name)
        state["accelerator"] = module.get_rng_state(acc.current_device_index())
    return state


def _split_state(state: dict[str, Any], master: torch.Tensor) -> tuple[dict, dict]:
    """(per-element tensors shaped like the master, scalars) of one master's optimizer state."""
    per_element, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.numel() == master.numel() and value.dim() > 0:
            per_element[key] = value
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            scalars[key] = value.detach().cpu().clone()
        elif isinstance(value, (int, float, bool)):
            scalars[key] = value
        else:
            raise TypeError(
                f"optimizer state {key!r} has shape {tuple(getattr(value, 'shape', ()))}, neither "
                f"the master's ({master.numel()} elements) nor a scalar; ZeRO checkpoints support "
                "elementwise optimizers only (SGD, Adam(W), Adagrad, RMSprop, ...)"
            )
    return per_element, scalars


@ranges.range("zero.checkpoint.save")
def save_checkpoint(
    opt: Any,
    model: nn.Module,
    save_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    client_state: dict[str, Any] | None = None,
    save_rng: bool = True,
    save_latest: bool = True,
    node_local: bool = False,
    exclude_frozen: bool = False,
) -> Path:
    """Save `opt` (a `ZeroOptimizer`) and `model` under `save_dir/tag`.

    Collective: every rank of the optimizer's group must call it. `tag` defaults to
    `global_step<N>`. `client_state` (picklable, rank 0's copy) comes back from
    `load_checkpoint`. Returns the tag directory, complete on return. Call it at an
    accumulation boundary (after `opt.step()` stepped, or before any backward).

    Parameters outside the optimizer (frozen ones) are saved whole by rank 0; under stage 3 they
    are gathered for it first (one all-gather of their shards); `exclude_frozen` leaves them out
    (DeepSpeed's `exclude_frozen_parameters`: a LoRA's checkpoint holds its adapters, not the
    frozen base model), and the tag then loads only with `strict=False`. With
    `ZeroConfig.stage3_gather_16bit_weights_on_model_save` the tag also holds the model's
    consolidated 16-bit state_dict (`pytorch_model.bin`, see `save_16bit_model`).

    `node_local`: the ranks may see different directories at `save_dir` (each node its own
    disk, DeepSpeed's `use_node_local_storage`): each storage gets its ranks' shards plus its
    own `common.pt`, `metadata.json` and `latest`. Without it, a directory that not every rank
    sees is refused on every rank before anything is written (Note [who shares the checkpoint
    directory]).

    Errors: an exception on any rank (a full disk, a bad state) raises `CheckpointError` on every
    rank, naming the rank and its error (Note [a checkpoint fails on every rank]); the tag is
    then left unsealed, and `latest` keeps naming the previous complete tag.
    `save_latest=False` leaves `latest` where it was (DeepSpeed's `save_latest`).
    """
    pending = snapshot(
        opt, model, save_dir, tag, client_state=client_state, save_rng=save_rng,
        node_local=node_local, exclude_frozen=exclude_frozen,
    )  # fmt: skip
    # Local: every rank writes its shard files; the sizes go to every leader.
    _, sizes = together(opt.comm_group, pending.what, pending.write_files, share=lambda s: s)

    # Local to the leaders: common.pt, the 16-bit model, then metadata.json (the seal), `latest`.
    def seal() -> None:
        if pending.storage.is_leader:
            pending.seal(sizes)
            if save_latest:
                pending.move_latest()

    together(opt.comm_group, pending.what, seal)  # nobody returns before the tag is sealed
    return pending.tag_dir


@ranges.range("zero.checkpoint.snapshot")
def snapshot(
    opt: Any,
    model: nn.Module,
    save_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    client_state: dict[str, Any] | None = None,
    save_rng: bool = True,
    node_local: bool = False,
    exclude_frozen: bool = False,
) -> PendingSave:
    """The collective half of `save_checkpoint`: a copy in host memory of everything the tag
    will hold, and the tag unsealed; the files are then written by `PendingSave` alone (no
    collective, so on a background thread if the caller likes).

    After it returns, training may change the model and optimizer freely. Host memory: this
    rank's (4 + K_state)·Ψ/N bytes, plus on the leaders `common.pt`'s contents.
    """
    group = opt.comm_group
    rank, world_size = comm.get_rank(group), comm.get_world_size(group)
    tag = tag if tag is not None else f"global_step{opt.global_step}"
    what = f"save_checkpoint of tag {tag!r}"
    root = Path(save_dir)
    tag_dir = root / tag

    # 1. Who sees the directory (two agreements; nothing written but a probe file).
    storage = probe_storage(group, rank, tag_dir, what, node_local=node_local)

    # 2. Local: check the moment, name this rank's pieces, unseal the tag (the leaders).
    _, everyone = together(
        group, what, lambda: _plan(opt, storage, tag_dir), share=lambda plan: plan
    )
    pieces = [e["pieces"] for e in everyone]
    peers = {r: g for g in storage.groups for r in g}
    owned_by = [_owned_pieces(pieces, r, peers[r]) for r in range(world_size)]
    optimized = {name for e in everyone for name in e["shapes"]}

    # 3. Collectives: the full values the leaders write whole (frozen parameters; 16-bit model).
    leader = storage.is_leader
    if exclude_frozen:  # named in the metadata, their values not gathered
        excluded = tuple(name for name, _ in model.named_parameters() if name not in optimized)
        frozen: dict[str, torch.Tensor] = {}
    else:
        excluded, frozen = (), gather_full(model, lambda name: name not in optimized, keep=leader)
    model16 = None
    if opt.config.stage3_gather_16bit_weights_on_model_save:
        model16 = gather_16bit_state_dict(model, keep=leader)

    # 4. Local: copy this rank's pieces (and the leaders' common state) into host memory.
    ((weights, states, rng, extra), _), packs = together(
        group,
        what,
        lambda: _pack(opt, owned_by[rank], save_rng),
        share=lambda packed: packed[1]["scalars_and_keys"],
    )
    pending = PendingSave(
        what=what,
        root=root,
        tag=tag,
        rank=rank,
        world_size=world_size,
        storage=storage,
        header={"format_version": FORMAT_VERSION, "rank": rank, "world_size": world_size,
                "tag": tag},
        weights=weights,
        states=states,
        rng=rng,
        extra=extra,
        owned=[tuple(o) for o in owned_by],
    )  # fmt: skip
    if leader:
        pending.common, pending.meta = _common_and_meta(
            opt, model, tag, world_size, everyone, packs, client_state, frozen,
            model16 is not None, excluded,
        )  # fmt: skip
        pending.model16 = model16
    return pending


def _plan(opt: Any, storage: StorageGroups, tag_dir: Path) -> dict[str, Any]:
    """This rank's pieces and parameter shapes (shared with every rank); leaders unseal the tag."""
    gas = opt.config.gradient_accumulation_steps
    if opt.window_micro_steps != 0:
        where = "at the end of" if opt.at_boundary else "inside"
        raise RuntimeError(
            f"save_checkpoint at micro-step {opt.micro_step} is {where} a gradient accumulation "
            f"window of {gas} micro-steps whose step was not taken; its gradients would be lost. "
            "Save after the opt.step() call that returned True"
        )
    fragments = opt.fragments()
    # An existing tag is about to be overwritten: unseal it first, so that a crash part-way
    # leaves an incomplete tag (refused by name) rather than a complete-looking mixture. Done
    # markers of an earlier save of this tag go too (they would seal it early: pending.py).
    if storage.is_leader:
        (tag_dir / METADATA_FILE).unlink(missing_ok=True)
        for marker in tag_dir.glob(DONE_GLOB):
            marker.unlink(missing_ok=True)
    return {
        "pieces": [(f.name, f.start, f.numel) for f in fragments if f.numel > 0],
        "shapes": {f.name: tuple(f.shape) for f in fragments},
    }


def _pack(opt: Any, owned: list[tuple[str, int, int]], save_rng: bool) -> tuple[Any, dict]:
    """This rank's weights and per-element optimizer state, packed into new host tensors."""
    by_name = {f.name: f for f in opt.fragments() if f.numel > 0}
    inner = opt.optimizer
    weights: list[tuple[str, int, torch.Tensor]] = []
    moments: dict[str, list[tuple[str, int, torch.Tensor]]] = {}  # state key -> pieces
    scalars: dict[tuple[str, int], dict[str, Any]] = {}
    # offload_optimizer nvme: the states are in swap files; this reads them into `state` for the
    # loop below (offload's SwappedOptimizer.states_in_memory; other optimizers have none).
    resident = getattr(inner, "states_in_memory", contextlib.nullcontext)
    with torch.no_grad(), resident():
        for name, start, numel in owned:
            f = by_name[name]
            master = inner.param_groups[f.group]["params"][f.master_index]
            lo = f.master_offset + (start - f.start)
            weights.append((name, start, master.reshape(-1)[lo : lo + numel]))
            per_element, scalar = _split_state(inner.state.get(master, {}), master)
            for key, value in per_element.items():
                moments.setdefault(key, []).append(
                    (name, start, value.reshape(-1)[lo : lo + numel])
                )
            if scalar:
                scalars[(name, start)] = scalar  # the leaders keep one per parameter
        # pack_pieces copies (torch.cat into a new host tensor): a snapshot, Ψ/N·(4 + K) bytes.
        packed = pack_pieces(weights)
        states = {key: pack_pieces(pieces) for key, pieces in moments.items()}
    shared = {"scalars_and_keys": {"scalars": scalars, "state_keys": sorted(moments)}}
    # State of this rank that is no fragment's (1-bit Adam's error-feedback residuals):
    # Note [a rank's extra state] in load.py.
    extra = getattr(opt, "rank_extra_state", lambda: None)()
    return (packed, states, _rng_state() if save_rng else None, extra), shared


def _common_and_meta(
    opt: Any,
    model: nn.Module,
    tag: str,
    world_size: int,
    everyone: list[dict[str, Any]],
    packs: list[dict[str, Any]],
    client_state: dict[str, Any] | None,
    frozen: dict[str, torch.Tensor],
    has_model16: bool,
    excluded: tuple[str, ...] = (),
) -> tuple[dict[str, Any], CheckpointMetadata]:
    """A leader's `common.pt` contents (copies) and the metadata without its shard records."""
    shapes: dict[str, tuple[int, ...]] = {}
    for e in everyone:
        shapes.update(e["shapes"])
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    fragment_group = {f.name: f.group for f in opt.fragments()}
    params = tuple(
        ParamRecord(name, shapes[name], fragment_group.get(name, -1), tuple(aliases[id(p)][1:]))
        for name, p in model.named_parameters()
        if name in shapes
    )
    # Scalar state (Adam's step) once per parameter: from its first piece that has any. (A
    # piece may lack state where another has it: stage 0/3 skip a master no rank used.)
    scalars: dict[str, dict[str, Any]] = {}
    for (name, _), value in sorted(
        ((k, v) for g in packs for k, v in g["scalars"].items()), key=lambda kv: kv[0][1]
    ):
        scalars.setdefault(name, value)
    inner = opt.optimizer
    hyper = copy.deepcopy(
        [{k: v for k, v in pg.items() if k != "params"} for pg in inner.param_groups]
    )
    buffers = {name: b.detach().cpu().clone() for name, b in model.named_buffers()}
    common = {
        "format_version": FORMAT_VERSION,
        "param_groups": hyper,
        "scalar_state": scalars,
        "loss_scaler": None
        if opt.loss_scaler is None
        else copy.deepcopy(opt.loss_scaler.state_dict()),
        "global_step": opt.global_step,
        "micro_step": opt.micro_step,
        "buffers": buffers,
        "frozen_params": frozen,
        "client_state": copy.deepcopy(client_state),
    }
    meta = CheckpointMetadata(
        format_version=FORMAT_VERSION,
        tag=tag,
        world_size=world_size,
        stage=opt.config.stage,
        global_step=opt.global_step,
        params=params,
        shards=(),
        optimizer_class=type(inner).__name__,
        state_keys=tuple(sorted({k for g in packs for k in g["state_keys"]})),
        state_dict_keys=tuple(k for k in _state_dict_keys(model) if k not in excluded),
        buffer_names=tuple(buffers),
        frozen_names=tuple(frozen),
        model_16bit_file=MODEL_16BIT_FILE if has_model16 else None,
        excluded_frozen_names=excluded,
    )
    return common, meta


def _state_dict_keys(module: nn.Module, prefix: str = "") -> list[str]:
    """``module.state_dict()``'s keys, in its order, without reading any tensor.

    (A released stage-3 parameter must not be touched outside its gathered context.)
    """
    keys = [prefix + n for n, p in module._parameters.items() if p is not None]
    keys += [
        prefix + n
        for n, b in module._buffers.items()
        if b is not None and n not in module._non_persistent_buffers_set
    ]
    for name, child in module._modules.items():
        if child is not None:
            keys += _state_dict_keys(child, prefix + name + ".")
    return keys
