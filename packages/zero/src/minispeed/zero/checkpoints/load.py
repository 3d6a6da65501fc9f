"""Load a ZeRO checkpoint into any world size and any stage ("universal" loading).

The checkpoint names every piece by (parameter name, flat range) (``layout.py``); this rank asks
its optimizer which ranges it holds now (``opt.fragments()``) and copies the intersection of each
saved piece with each of its fragments into its fp32 masters and optimizer state. Nothing in
that depends on the world size or stage that wrote the checkpoint; the same code resumes a run
exactly (same world size: every element comes back bit for bit, and with it the RNG states) or
continues it on 4 ranks at stage 3 from 2 ranks at stage 2.

Host memory while loading: the saved shards are opened one at a time with ``mmap``, so only the
pages of pieces this rank needs are read: about (4 + K_state)·Ψ/N bytes per rank in total.
Each rank reads metadata.json, common.pt and the shards that overlap its fragments.
"""

from __future__ import annotations

import inspect
import os
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator
from minispeed.zero.checkpoints.agree import together
from minispeed.zero.checkpoints.layout import (
    COMMON_FILE,
    CheckpointError,
    CheckpointMetadata,
    iter_pieces,
    load_shard,
    read_metadata,
    resolve_tag_dir,
)
from minispeed.zero.stage3.init import GatheredParameters

__all__ = ["load_checkpoint"]


def _check_model_matches(
    model: nn.Module,
    opt_shapes: dict[str, tuple[int, ...]],
    meta: CheckpointMetadata,
    strict: bool = True,
) -> None:
    """Same parameter names and shapes as the checkpoint, or an error naming the first mismatch.
    `strict=False` lets the frozen parameters differ: the model's missing from the checkpoint
    keep their values, the checkpoint's missing from the model are skipped."""
    saved = {p.name: p.shape for p in meta.params}
    canonical = {alias: p.name for p in meta.params for alias in p.aliases}
    frozen = set(meta.frozen_names)
    seen = set()
    for name, _ in model.named_parameters():
        if name in opt_shapes:
            shape = opt_shapes[name]
            key = canonical.get(name, name)
            if key not in saved:
                raise CheckpointError(
                    f"model parameter {name!r} {shape} is not in the checkpoint (which has "
                    f"{len(saved)} parameters, e.g. {next(iter(saved), None)!r}); load into the "
                    "model architecture that saved it, or rename the parameter"
                )
            if tuple(saved[key]) != tuple(shape):
                raise CheckpointError(
                    f"parameter {name!r} has shape {tuple(shape)} in the model but "
                    f"{tuple(saved[key])} in the checkpoint; build the model with the "
                    "configuration that saved the checkpoint"
                )
            seen.add(key)
        elif name not in frozen and strict:
            if name in meta.excluded_frozen_names:
                raise CheckpointError(
                    f"frozen parameter {name!r} was left out of this checkpoint (saved with "
                    "exclude_frozen_parameters=True); load it with load_module_strict=False "
                    "(zero's strict=False) to keep the model's own frozen values"
                )
            raise CheckpointError(
                f"model parameter {name!r} is neither optimized nor saved as frozen in the "
                "checkpoint; load into the model architecture that saved it"
            )
    names = {name for name, _ in model.named_parameters()}
    lost = [n for n in meta.frozen_names if n not in names]
    if lost and strict:
        raise CheckpointError(
            f"checkpoint frozen parameter {lost[0]!r} does not exist in the model ({len(lost)} "
            "frozen parameters are unmatched); load into the model architecture that saved it"
        )
    extra = [n for n in saved if n not in seen]
    if extra:
        raise CheckpointError(
            f"checkpoint parameter {extra[0]!r} {tuple(saved[extra[0]])} does not exist in the "
            f"model ({len(extra)} checkpoint parameters are unmatched); load into the model "
            "architecture that saved it"
        )


def _restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["cpu"])
    acc = get_accelerator()
    if rng.get("accelerator") is not None and acc.name == rng["accelerator_name"]:
        torch.get_device_module(acc.name).set_rng_state(
            rng["accelerator"], acc.current_device_index()
        )


@ranges.range("zero.checkpoint.load")
def load_checkpoint(
    opt: Any,
    model: nn.Module,
    load_dir: str | os.PathLike,
    tag: str | None = None,
    *,
    load_optimizer_states: bool = True,
    load_rng: bool = True,
    strict: bool = True,
) -> dict[str, Any] | None:
    """Restore a checkpoint written by `save_checkpoint` into ``opt``/``model``.

    Collective: every rank of the optimizer's group calls it. ``tag`` defaults to the one named
    in ``load_dir/latest``. Works for any world size and stage (fp32 masters and per-element
    optimizer state are re-sliced; scalar state such as Adam's ``step`` is shared by all pieces).
    RNG states are restored only on the world size that saved them. Returns the saved
    ``client_state``.

    A tag saved with `node_local=True` holds, in each directory, the shards of the ranks that
    saw it (`metadata.json`'s `node_local_ranks`): only those are checked and read, so it loads
    at the same world size with the same ranks per directory (anything else names the ranks).

    Errors: an incomplete tag (interrupted save), another format version, or a model whose
    parameter names/shapes differ from the checkpoint's (the first mismatch is named).
    `strict=False` (DeepSpeed's `load_module_strict=False`) tolerates frozen parameters that
    differ: those the checkpoint lacks (saved with `exclude_frozen`) keep the model's values.
    """
    group = opt.comm_group
    rank, world_size = comm.get_rank(group), comm.get_world_size(group)
    what = f"load_checkpoint from {os.fspath(load_dir)!r}" + (f" (tag {tag!r})" if tag else "")

    # 1. Local: find and check the tag; name this rank's fragments.
    def find() -> tuple[Path, CheckpointMetadata, list[Any]]:
        tag_dir = resolve_tag_dir(load_dir, tag)
        meta = read_metadata(tag_dir, need_optimizer_state=load_optimizer_states)
        return tag_dir, meta, list(opt.fragments())

    (tag_dir, meta, fragments), everyone = together(
        group,
        what,
        find,
        share=lambda found: ({f.name: tuple(f.shape) for f in found[2]}, comm.get_rank()),
    )
    shapes: dict[str, tuple[int, ...]] = {}
    for part, _ in everyone:
        shapes.update(part)
    first_global_rank = everyone[0][1]  # global rank of group rank 0 (broadcast source)

    # ZeRO-Infinity (offload's SwappedMastersOptimizer): the masters are meta handles whose
    # values live in swap files; phases 2-3 fill real tensors that go back to the files after.
    inner = opt.optimizer
    in_files = getattr(inner, "masters_in_files", False)
    with inner.states_in_memory() if in_files else nullcontext():
        # 2. Local: fill this rank's masters and optimizer state from the shards that hold them.
        def check_and_read() -> Any:
            _check_model_matches(model, shapes, meta, strict)
            if load_optimizer_states:
                _check_optimizer_matches(inner, meta, tag_dir)
            return _read(
                opt,
                model,
                tag_dir,
                meta,
                fragments,
                shapes,
                rank,
                world_size,
                load_rng,
                load_optimizer_states,
            )

        (common, mine, masters, state_filled, rng), _ = together(group, what, check_and_read)

        # 3. Local: scalars, hyper-parameters, counters, buffers.
        def restore() -> None:
            if load_optimizer_states:
                _restore_scalars_and_hyper(opt, meta, common, mine, masters, state_filled)
            # offload_optimizer nvme: move the loaded masters (and states) into the swap files
            # here, inside the agreement, so a failed write raises on every rank.
            getattr(opt.optimizer, "absorb_states", lambda: None)()
            if opt.loss_scaler is not None and common["loss_scaler"] is not None:
                opt.loss_scaler.load_state_dict(common["loss_scaler"])
            opt.global_step = common["global_step"]
            opt.micro_step = common["micro_step"]  # saved between windows (save.py)
            _restore_buffers(model, common)
            if rng is not None:
                _restore_rng(rng)

        together(group, what, restore)

    # 4. Collectives: frozen parameters (re-partitioned from rank 0's copy under stage 3), then
    # masters -> model parameters (all-gather for stages 1-2).
    _restore_frozen(model, common, first_global_rank)
    opt.strategy.publish_params()
    after_load = getattr(opt, "after_load", None)
    if after_load is not None:  # See Note [a rank's extra state]
        own = tag_dir / meta.shards[rank].optim_file if rank < len(meta.shards) else None

        def read_extra() -> Any:
            if not (load_optimizer_states and meta.world_size == world_size and own.is_file()):
                return None
            return load_shard(own, meta.tag, mmap=True, weights_only=True).get("extra")

        extra, _ = together(group, what, read_extra)
        after_load(extra, states_loaded=load_optimizer_states)  # collective
    return common["client_state"]


# Note [a rank's extra state]
# Some optimizer state belongs to a rank, not to any parameter fragment: 1-bit Adam's
# error-feedback residuals (zero/onebit.py) are what this rank's compression lost, sized by the
# world size. An optimizer that has such state defines `rank_extra_state()` (saved in its rank's
# optim file under "extra") and `after_load(extra, states_loaded=...)`, called collectively at
# the end of a load with that rank's saved value, or None where the world size changed (or the
# optimizer states are not loaded), so it can rebuild what it derives from the loaded state and
# start the rest afresh.


def _read(
    opt, model, tag_dir, meta, fragments, shapes, rank, world_size, load_rng, load_optimizer_states
):
    """Phase 2 of `load_checkpoint`: open exactly the shards whose pieces meet this rank's
    fragments (mapped: only the pages copied are read) and copy the overlaps in (the model
    checked against the checkpoint first)."""
    canonical = {alias: p.name for p in meta.params for alias in p.aliases}
    # Our fragments by the checkpoint's name of their parameter.
    mine: dict[str, list[Any]] = defaultdict(list)
    for f in fragments:
        if f.numel > 0:
            mine[canonical.get(f.name, f.name)].append(f)

    # weights_only=False: common.pt carries the caller's client_state (load checkpoints you trust).
    common = load_shard(tag_dir / COMMON_FILE, meta.tag, map_location="cpu", weights_only=False)
    inner = opt.optimizer
    masters = {
        (f.group, f.master_index): inner.param_groups[f.group]["params"][f.master_index]
        for f in fragments
    }
    for m in masters.values():
        if not m.is_contiguous():
            raise RuntimeError(
                "ZeRO master tensors must be contiguous to be filled from a checkpoint"
            )

    filled: dict[tuple[str, int], int] = defaultdict(int)
    state_filled: dict[tuple[int, int], bool] = {}
    load_states = load_optimizer_states and bool(meta.state_keys)
    same_world = meta.world_size == world_size
    rng = None
    for shard in meta.local_shards():  # node-local: the shards this storage holds
        if not any(any(True for _ in _overlaps(mine.get(n, ()), a, k)) for n, a, k in shard.pieces):
            continue  # none of our fragments is in this shard: do not even open it
        _copy_weights(tag_dir / shard.weights_file, meta.tag, mine, masters, filled)
        if load_states:
            saved = _copy_states(
                tag_dir / shard.optim_file,
                meta.tag,
                mine,
                masters,
                inner,
                meta.state_keys,
                state_filled,
            )
            if same_world and shard.rank == rank:
                rng = saved["rng"]

    damage = next(
        (
            f"checkpoint {tag_dir} holds {filled[(name, f.start)]} of the {f.numel} elements "
            f"[{f.start}, {f.start + f.numel}) of parameter {name!r} that rank {rank} needs; it is "
            "damaged (re-save it, or load an earlier tag)"
            for name, fs in mine.items()
            for f in fs
            if filled[(name, f.start)] != f.numel
        ),
        None,
    )
    if damage is not None and meta.node_local_ranks is not None:
        raise CheckpointError(
            f"{damage.split('; it is damaged')[0]}: the checkpoint was saved to node-local "
            f"storage and this rank's directory holds the shards of ranks "
            f"{list(meta.node_local_ranks)} of {meta.world_size} only. Load on the same world "
            "size with the same ranks on each node, or copy every node's files into one directory"
        )
    if damage is not None:
        raise CheckpointError(damage)

    if (
        load_rng
        and same_world
        and rng is None
        and meta.shards[rank] in meta.local_shards()
        and (tag_dir / meta.shards[rank].optim_file).is_file()
    ):
        own = tag_dir / meta.shards[rank].optim_file  # our own file, opened for the RNG only
        rng = load_shard(own, meta.tag, mmap=True, weights_only=True)["rng"]
    return common, mine, masters, state_filled, rng if load_rng else None


@torch.no_grad()
def _copy_weights(path, tag, mine, masters, filled) -> None:
    """Copy the saved fp32 pieces of one shard file that overlap our fragments into the masters."""
    saved = load_shard(path, tag, mmap=True, weights_only=True)  # pages read only where we copy
    for name, start, values in iter_pieces(saved):
        for f, lo, hi in _overlaps(mine.get(name, ()), start, values.numel()):
            dst = masters[(f.group, f.master_index)].view(-1)
            dst[f.master_offset + lo - f.start : f.master_offset + hi - f.start].copy_(
                values[lo - start : hi - start]
            )
            filled[(name, f.start)] += hi - lo


@torch.no_grad()
def _copy_states(path, tag, mine, masters, inner, keys, state_filled) -> dict[str, Any]:
    """The same for each per-element optimizer state tensor (exp_avg, ...); returns the file."""
    saved = load_shard(path, tag, mmap=True, weights_only=True)
    for key, packed in saved["state"].items():
        for name, start, values in iter_pieces(packed):
            for f, lo, hi in _overlaps(mine.get(name, ()), start, values.numel()):
                where = (f.group, f.master_index)
                dst = _element_state(inner, masters[where], keys, state_filled, where)[key].view(-1)
                dst[f.master_offset + lo - f.start : f.master_offset + hi - f.start].copy_(
                    values[lo - start : hi - start]
                )
    return saved


def _overlaps(fragments, start: int, numel: int):
    """(fragment, lo, hi) for each fragment whose range meets [start, start + numel)."""
    for f in fragments:
        lo, hi = max(start, f.start), min(start + numel, f.start + f.numel)
        if lo < hi:
            yield f, lo, hi


def _element_state(inner, master, keys, state_filled, key) -> dict[str, torch.Tensor]:
    """The master's optimizer state, created (zeros) for ``keys`` the first time it is touched."""
    if key not in state_filled:
        inner.state[master] = {k: torch.zeros_like(master) for k in keys}
        state_filled[key] = True
    return inner.state[master]


def _element_state_keys(inner: torch.optim.Optimizer) -> set[str] | None:
    """The per-element state `inner`'s class keeps (Adam: exp_avg, exp_avg_sq), read from one
    step of a copy over a 2-element tensor: a few hundred bytes. Only torch.optim's own classes
    are probed (their step is local; another's might call a collective, or need arguments its
    `defaults` do not hold): None for the rest, and when no copy can be built."""
    if not type(inner).__module__.startswith("torch.optim."):
        return None
    try:
        takes = inspect.signature(type(inner)).parameters  # AdamW's defaults hold more
        anything = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in takes.values())
        probe = torch.zeros(2, requires_grad=True)
        copy = type(inner)(
            [probe], **{k: v for k, v in inner.defaults.items() if anything or k in takes}
        )
        probe.grad = torch.ones(2)
        copy.step()
        state = copy.state[probe]
    except Exception:
        return None
    return {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == probe.shape}


def _check_optimizer_matches(
    inner: torch.optim.Optimizer, meta: CheckpointMetadata, tag_dir
) -> None:
    """Refuse optimizer state this optimizer cannot step with: a checkpoint of SGD with momentum
    loaded into Adam would fail at the first step, naming only a missing ``'exp_avg'``."""
    saved = set(meta.state_keys)
    needed = _element_state_keys(inner) if saved else None
    if needed is not None and not needed <= saved:
        raise CheckpointError(
            f"checkpoint {tag_dir} holds the optimizer state {sorted(saved)} per element, but "
            f"this optimizer ({type(inner).__name__}) keeps {sorted(needed)}: the checkpoint was "
            "saved with another optimizer or other settings (amsgrad, momentum). Build the "
            "optimizer it was saved with, or pass load_optimizer_states=False to load the "
            "weights and start the optimizer afresh"
        )


def _restore_scalars_and_hyper(opt, meta, common, mine, masters, state_filled) -> None:
    """Hyper-parameters per param group, and scalar state (Adam's ``step``) per master tensor."""
    inner = opt.optimizer
    saved_groups = common["param_groups"]
    if len(saved_groups) != len(inner.param_groups):
        raise CheckpointError(
            f"the checkpoint has {len(saved_groups)} optimizer param groups, this optimizer "
            f"{len(inner.param_groups)}; build the optimizer with the same groups, or pass "
            "load_optimizer_states=False to load the weights only"
        )
    for pg, saved in zip(inner.param_groups, saved_groups):
        pg.update({k: v for k, v in saved.items() if k != "params"})
    scalars = common["scalar_state"]
    for name, fs in mine.items():
        for f in fs:
            key = (f.group, f.master_index)
            if key in state_filled and name in scalars:
                state = inner.state[masters[key]]
                for k, v in scalars[name].items():
                    state.setdefault(k, _scalar_for(v, inner.param_groups[f.group], masters[key]))
    # A master whose pieces carried moments but no scalar (its parameters had no state when
    # saved, e.g. an unused one) takes the scalars of its param group's other masters.
    for key in state_filled:
        state = inner.state[masters[key]]
        for other in state_filled:
            if other[0] == key[0]:
                for k, v in inner.state[masters[other]].items():
                    if k not in meta.state_keys and k not in state:
                        state[k] = _scalar_for(v, inner.param_groups[key[0]], masters[key])


def _scalar_for(value: Any, group: dict[str, Any], master: torch.Tensor) -> Any:
    """A fresh copy of a scalar state value, on the master's device where the optimizer wants it."""
    if not isinstance(value, torch.Tensor):
        return value
    on_device = group.get("capturable") or group.get("fused")
    return value.to(master.device, copy=True) if on_device else value.clone()


def _restore_buffers(model: nn.Module, common: dict[str, Any]) -> None:
    """Model buffers, saved whole by rank 0 (stage 3 does not partition buffers)."""
    with torch.no_grad():
        buffers = dict(model.named_buffers())
        for name, value in common["buffers"].items():
            if name in buffers:
                buffers[name].copy_(value)


def _restore_frozen(model: nn.Module, common: dict[str, Any], src: int) -> None:
    """Frozen (non-optimized) parameters, saved whole by rank 0. Collective under stage 3: the
    values are written inside `GatheredParameters` and re-partitioned from global rank `src`."""
    params = dict(model.named_parameters())
    saved = {n: v for n, v in common["frozen_params"].items() if n in params}  # strict: all
    with torch.no_grad(), GatheredParameters([params[n] for n in saved], modifier_rank=src):
        for name, value in saved.items():
            params[name].data.copy_(value)
