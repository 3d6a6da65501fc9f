"""Checkpoints written by DeepSpeed itself: read, unflattened per parameter, loaded into minispeed.

A job moved from DeepSpeed to minispeed resumes from the checkpoints DeepSpeed wrote:
`engine.load_checkpoint(dir)` on such a directory restores the weights, the fp32 masters, the
optimizer's moments and step, the scheduler, the counters and the client state, as
DeepSpeed's own `load_checkpoint` would, at any data-parallel size (`load.py` calls
`load_deepspeed` when the tag holds DeepSpeed's files); `get_fp32_state_dict_from_zero_checkpoint`
and the `zero_to_fp32` command read them through `to_zero_checkpoint` too (`weights_tag_dir`).
A universal checkpoint's folder (`zero/`, DeepSpeed's `ds_to_universal`) is read by
`universal.py` into the same `DeepSpeedTag` and loads the same way.

DeepSpeed's layout (0.19.8; the keys read are the ones of its `runtime/engine.py` and ZeRO
optimizers' `state_dict`s), one tag directory, N data-parallel ranks:

```text
<dir>/latest                                      "<tag>"
<dir>/<tag>/mp_rank_00_model_states.pt            stages 0-2: rank 0's engine state (below)
<dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt   stage 3: the same, one per rank
<dir>/<tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   stages 1-3: rank r's ZeRO optimizer
<dir>/<tag>/bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt   the same with bf16
```

- *model states*: `module` (the module's `state_dict`, in the training dtype; empty tensors at
  stage 3), `param_shapes` (one `{name: shape}` per optimizer param group, in the order of the
  flat buffers), `buffer_names`, `shared_params` (`{tied name: the name it shares}`),
  `frozen_param_shapes`, `lr_scheduler` (its `state_dict`), `global_steps`, `global_samples`,
  `skipped_steps`, `dp_world_size`, `mp_world_size`, `ds_config`, `ds_version`, and the caller's
  `client_state` keys at the top level. At stage 0, `optimizer` holds the optimizer itself:
  torch's `state_dict` (fp32; the masters are the module's weights) or DeepSpeed's bf16 / fp16
  wrapper's (`fp32_groups`: the masters per group and parameter, `optimizer_state_dict`).
- *optim states*, stages 1-2, `optimizer_state_dict`: `single_partition_of_fp32_groups[g]`, rank
  r's slice of group g's flat fp32 buffer (the group's parameters flattened back to back in
  `param_shapes[g]` order, padded at the end to a multiple of 2·N, cut in N equal slices; the
  last rank's padding stripped), `base_optimizer_state` (torch's `state_dict` of the inner
  optimizer, whose "parameters" are those slices: `exp_avg`... of the same layout, padding
  kept), `zero_stage`, `partition_count`, `group_paddings`, `loss_scaler`.
- *optim states*, stage 3, `optimizer_state_dict`: `fp32_flat_groups[g]`, rank r's pieces of
  every parameter of group g back to back: each parameter of `numel` elements is cut into N
  pieces of ⌈numel/N⌉ (the last padded), piece r kept by rank r; `optimizer_state_dict` (torch's,
  over those flat groups), `zero_stage`, `partition_count`, `loss_scaler`.

Reading one tag (`read_tag`) joins rank r's pieces back into whole fp32 tensors per parameter
name: masters, every per-element state (Adam's `exp_avg`, `exp_avg_sq`) and the scalar state
(`step`) per group, the param groups' hyper-parameters, the loss scale; the parameter names come
from `param_shapes` (at stage 0 there are none: DeepSpeed's own load is positional, so are we,
in the order of the loading optimizer's groups, and each tensor's shape is checked). The result is
written as a one-rank `minispeed.zero` checkpoint in a private temporary directory
(`resplit.write_one_rank`), which `zero.load_checkpoint` re-slices over this engine's ranks.

Refused, naming the file and what to do: pipeline (`layer_*-model_states.pt`), tensor-parallel
(`mp_rank_01...`) and MoE (`expert_*` / `expp_rank`) checkpoints, a `ds_version` missing or unreadable, a file that lacks a key this reader needs,
a missing rank's file, and (stage 3) frozen parameters.

Safety: DeepSpeed's pickles are opened `weights_only` with inert stand-ins for its four objects
(`deepspeed_tag.py`), so DeepSpeed need not be installed and no code from the file runs.

Cost per loading rank: reads every file of the tag, (4 + K)·Ψ bytes of fp32 masters and moments
(K: optimizer bytes per parameter, 8 for Adam) plus the 16-bit module, holds the whole joined
state in host memory at once ((4 + K)·Ψ bytes) and writes it to the temporary directory.
"""

from __future__ import annotations

import contextlib
import math
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import minispeed.zero as zero
from minispeed.engine.checkpoint.deepspeed_tag import (
    MODEL_STATES,
    DeepSpeedTag,
    GroupState,
    check_version,
    group_hyper,
    is_per_element,
    need,
    open_file,
    scalar_state,
    shape_numel,
)
from minispeed.engine.checkpoint.grid import ENGINE_STATE
from minispeed.engine.checkpoint.universal import is_universal_tag, read_universal
from minispeed.zero.checkpoints import (
    FORMAT_VERSION,
    CheckpointError,
    CheckpointMetadata,
    ParamRecord,
    together,
)

__all__ = [
    "DeepSpeedTag",
    "deepspeed_weights",
    "engine_payload",
    "is_deepspeed_tag",
    "load_deepspeed",
    "read_tag",
    "to_zero_checkpoint",
    "weights_tag_dir",
]

_ZERO_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(optim|model)_states\.pt$")
_TAG = "deepspeed"


def is_deepspeed_tag(tag_dir: Path) -> bool:
    """Whether `tag_dir` holds DeepSpeed's files (and none of minispeed's seals)."""
    if not tag_dir.is_dir() or (tag_dir / zero.checkpoints.METADATA_FILE).is_file():
        return False
    return any(p.name.endswith("model_states.pt") for p in tag_dir.iterdir())


def _refuse_unsupported(tag_dir: Path) -> None:
    names = sorted(p.name for p in tag_dir.iterdir())
    kinds = [
        (lambda n: "expert_" in n or "expp_rank" in n, "an MoE checkpoint (expert files)"),
        (lambda n: re.match(r"layer_\d+-model_states", n) is not None,
         "a pipeline checkpoint (one file per layer)"),
        (lambda n: re.search(r"mp_rank_(?!00_)\d+", n) is not None,
         "a tensor- or pipeline-parallel checkpoint (mp_rank above 00)"),
    ]  # fmt: skip
    for test, what in kinds:
        hit = next((n for n in names if test(n)), None)
        if hit is not None:
            raise CheckpointError(
                f"{tag_dir / hit}: this DeepSpeed tag is {what}, which minispeed does not read; "
                "only data-parallel ZeRO checkpoints (stages 0-3) load. Convert it to fp32 weights "
                "with DeepSpeed's zero_to_fp32.py and load those (the optimizer state starts anew)"
            )


def _optim_files(tag_dir: Path) -> list[Path]:
    """Rank 0..N-1's optimizer files, every one present (or [] at stage 0)."""
    found = {}
    for p in tag_dir.iterdir():
        m = _ZERO_FILE.match(p.name)
        if m and m.group(4) == "optim":
            found[int(m.group(2))] = p
    missing = [r for r in range(len(found)) if r not in found]
    if missing:
        raise CheckpointError(
            f"DeepSpeed checkpoint {tag_dir} lacks the optimizer file of data-parallel rank "
            f"{missing[0]} (it has ranks {sorted(found)}): copy every rank's "
            "zero_pp_rank_*_optim_states.pt file into it"
        )
    return [found[r] for r in range(len(found))]


def read_tag(tag_dir: Path) -> DeepSpeedTag:
    """Everything one DeepSpeed tag holds, per parameter (module docstring); a universal
    checkpoint's folder is read by `universal.read_universal`."""
    _refuse_unsupported(tag_dir)
    if is_universal_tag(tag_dir):
        return read_universal(tag_dir)
    optim_files = _optim_files(tag_dir)
    states_path = tag_dir / MODEL_STATES
    if not states_path.is_file():  # stage 3: one model-states file per rank, the same counters
        states_path = tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if not states_path.is_file():
        raise CheckpointError(
            f"DeepSpeed checkpoint {tag_dir} has neither {MODEL_STATES} nor "
            "zero_pp_rank_0_mp_rank_00_model_states.pt: copy the whole tag directory"
        )
    states = open_file(states_path)
    check_version(states, states_path)
    saved_by = states.get("dp_world_size", len(optim_files))
    if optim_files and saved_by != len(optim_files):
        raise CheckpointError(
            f"DeepSpeed checkpoint {tag_dir} was written by {saved_by} data-parallel ranks "
            f"({states_path.name}) but holds the optimizer files of ranks 0-"
            f"{len(optim_files) - 1} only: copy every rank's zero_pp_rank_*_optim_states.pt "
            "file into it"
        )
    if not optim_files:
        return _read_stage0(tag_dir, states, states_path)
    ranks = [
        need(open_file(p), "optimizer_state_dict", p, "ZeRO's optimizer state") for p in optim_files
    ]
    stage = need(ranks[0], "zero_stage", optim_files[0], "the ZeRO stage")
    shapes = need(states, "param_shapes", states_path, "the parameters of each flat group")
    if stage == 3:
        if states.get("frozen_param_shapes"):
            raise CheckpointError(
                f"DeepSpeed checkpoint {tag_dir} has frozen parameters at ZeRO stage 3 "
                f"({list(states['frozen_param_shapes'])[:3]}...), which this reader does not "
                "join; load it with DeepSpeed, or convert it to fp32 weights with zero_to_fp32.py"
            )
        groups = _join_stage3(optim_files, ranks, shapes)
    else:
        groups = _join_stage12(optim_files, ranks, shapes)
    scaler = ranks[0].get("loss_scaler")
    return DeepSpeedTag(
        tag_dir, stage, len(optim_files), states, groups,
        None if scaler is None else dict(vars(scaler)),
        {k: v for k, v in (states.get("shared_params") or {}).items()},
    )  # fmt: skip


def _read_stage0(tag_dir: Path, states: dict[str, Any], path: Path) -> DeepSpeedTag:
    """Stage 0: the optimizer's own state in the model-states file, per parameter already."""
    saved = need(states, "optimizer", path, "the optimizer state at ZeRO stage 0")
    module = need(states, "module", path, "the module's state_dict")
    if isinstance(saved, dict) and "state" in saved and "param_groups" in saved:
        inner = saved  # torch's: the masters are the fp32 module's weights (by name, later)
        if any(t.is_floating_point() and t.dtype != torch.float32 for t in module.values()):
            raise CheckpointError(
                f"DeepSpeed checkpoint file {path} holds 16-bit weights and a torch optimizer "
                "at stage 0, with no fp32 masters to resume from; load it with DeepSpeed"
            )
        masters_by_group = [[None] * len(pg["params"]) for pg in inner["param_groups"]]
    elif isinstance(saved, dict) and "fp32_groups" in saved:  # DeepSpeed's bf16/fp16 wrapper
        inner = need(saved, "optimizer_state_dict", path, "the inner optimizer's state")
        masters_by_group = [[m.float().clone() for m in ms] for ms in saved["fp32_groups"]]
    else:
        raise CheckpointError(
            f"DeepSpeed checkpoint file {path}: its stage-0 optimizer state has keys "
            f"{sorted(saved) if isinstance(saved, dict) else type(saved).__name__}, a layout this "
            "reader does not know; convert the weights with DeepSpeed's zero_to_fp32.py"
        )
    groups = []
    flat_index = 0
    for pg, masters in zip(inner["param_groups"], masters_by_group, strict=True):
        per = [inner["state"].get(flat_index + i, {}) for i in range(len(masters))]
        flat_index += len(masters)
        keys = sorted({k for s in per for k, v in s.items() if is_per_element(v)})
        moments = {k: [s[k] for s in per] for k in keys}
        scalars = [scalar_state(s, keys) for s in per]
        groups.append(GroupState(None, group_hyper(pg), masters, moments, scalars))
    scaler = {"cur_scale": saved.get("cur_scale", 1.0), "dynamic": False}
    return DeepSpeedTag(tag_dir, 0, states.get("dp_world_size", 1), states, groups, scaler)


def _inner_group(inner: dict[str, Any], g: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, hyper-parameters) of flat group g in a ZeRO rank's inner optimizer state dict."""
    state = inner["state"].get(g, {})
    return state, group_hyper(inner["param_groups"][g])


def _join_stage12(paths: list[Path], ranks: list[dict], shapes: list[dict]) -> list[GroupState]:
    """Stages 1-2: concatenate the ranks' slices of each group's flat buffer, cut it per
    parameter in `param_shapes` order (the padding at the end dropped)."""
    masters_key, base_key = "single_partition_of_fp32_groups", "base_optimizer_state"
    slices = [need(r, masters_key, p, "the fp32 masters") for r, p in zip(ranks, paths)]
    inners = [need(r, base_key, p, "the inner optimizer's state") for r, p in zip(ranks, paths)]
    groups = []
    for g, named in enumerate(shapes):
        numels = [shape_numel(s) for s in named.values()]
        flat = torch.cat([s[g].float() for s in slices])
        per_rank = [_inner_group(inner, g) for inner in inners]
        state0, hyper = per_rank[0]
        keys = sorted(k for k, v in state0.items() if is_per_element(v))
        # The moments keep the padding the masters lost: each rank's first len(slice) elements.
        flats = {
            k: torch.cat([st[k].float()[: s[g].numel()] for (st, _), s in zip(per_rank, slices)])
            for k in keys
        }
        if flat.numel() < sum(numels):
            raise CheckpointError(
                f"DeepSpeed checkpoint {paths[0].parent}: param group {g}'s flat buffer has "
                f"{flat.numel()} elements over {len(paths)} ranks, its parameters "
                f"{sum(numels)}: a rank's file is from another save; copy the tag again"
            )
        masters = _cut(flat, named)
        moments = {k: _cut(v, named) for k, v in flats.items()}
        scalar = scalar_state(state0, keys)
        groups.append(GroupState(list(named), hyper, masters, moments, [scalar] * len(masters)))
    return groups


def _cut(flat: torch.Tensor, named: dict[str, Any]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in named.values():
        n = shape_numel(shape)
        out.append(flat[offset : offset + n].clone().view(tuple(shape)))
        offset += n
    return out


def _join_stage3(paths: list[Path], ranks: list[dict], shapes: list[dict]) -> list[GroupState]:
    """Stage 3: every parameter is cut in N pieces of ⌈numel/N⌉; rank r's flat group holds its
    piece of each parameter back to back. Join the pieces, drop the last one's padding."""
    n_ranks = len(paths)
    flats = [need(r, "fp32_flat_groups", p, "the fp32 masters") for r, p in zip(ranks, paths)]
    inners = [need(r, "optimizer_state_dict", p, "the inner optimizer's state")
              for r, p in zip(ranks, paths)]  # fmt: skip
    groups = []
    for g, named in enumerate(shapes):
        per_rank = [_inner_group(inner, g) for inner in inners]
        state0, hyper = per_rank[0]
        keys = sorted(k for k, v in state0.items() if is_per_element(v))
        sources = {"master": [f[g].float() for f in flats]}
        sources |= {k: [st[k].float() for st, _ in per_rank] for k in keys}
        joined: dict[str, list[torch.Tensor]] = {k: [] for k in sources}
        offset = 0
        for shape in named.values():
            numel = shape_numel(shape)
            piece = math.ceil(numel / n_ranks)
            for k, per in sources.items():
                whole = torch.cat([t[offset : offset + piece] for t in per])[:numel]
                joined[k].append(whole.clone().view(tuple(shape)))
            offset += piece
        if any(f[g].numel() != offset for f in flats):
            raise CheckpointError(
                f"DeepSpeed checkpoint {paths[0].parent}: param group {g} holds "
                f"{[f[g].numel() for f in flats]} elements per rank, its parameters need "
                f"{offset}: a rank's file is from another save; copy the tag again"
            )
        masters = joined.pop("master")
        scalar = scalar_state(state0, keys)
        groups.append(GroupState(list(named), hyper, masters, joined, [scalar] * len(masters)))
    return groups


# -- into minispeed ---------------------------------------------------------------------------------


def _loss_scaler(found: DeepSpeedTag, skipped: int) -> dict[str, Any] | None:
    """minispeed's `LossScaler.state_dict` from DeepSpeed's dynamic scaler (None: static, the
    engine keeps the scale its config gives, as DeepSpeed's would)."""
    s = found.loss_scaler
    if not s or not s.get("dynamic"):
        return None
    return {
        "scale": float(s["cur_scale"]),
        "clean_steps": int(s["cur_iter"]) - int(s["last_overflow_iter"]) - 1,
        "hysteresis_left": int(s["cur_hysteresis"]),
        "overflows": skipped,
    }


def _accumulation(states: dict[str, Any]) -> int:
    """The run's gradient accumulation steps, from the ds_config DeepSpeed stored."""
    return int((states.get("ds_config") or {}).get("gradient_accumulation_steps", 1) or 1)


def to_zero_checkpoint(found: DeepSpeedTag, payload: dict[str, Any] | None = None) -> Path:
    """`found` as a one-rank `minispeed.zero` checkpoint in a new temporary directory (tag
    `"deepspeed"`, the caller removes it): masters, moments and scalars per parameter, the
    hyper-parameters, counters, buffers, frozen weights and loss scale. `payload` is the
    client state stored (the engine's counters and scheduler); DeepSpeed's by default."""
    from minispeed.engine.checkpoint.resplit import write_one_rank

    states, named = found.states, found.named()
    module = states.get("module") or {}
    buffer_names = tuple(states.get("buffer_names") or ())
    frozen = {n: t for n, t in module.items() if n not in named and n not in buffer_names}
    frozen = {n: t.float() if t.is_floating_point() else t for n, t in frozen.items()}
    frozen = {n: t for n, t in frozen.items() if n not in found.aliases}
    aliases: dict[str, list[str]] = {}
    for tied, name in found.aliases.items():
        aliases.setdefault(name, []).append(tied)
    weights, moments, scalars = {}, {}, {}
    for name, (g, i) in named.items():
        group = found.groups[g]
        weights[name] = group.masters[i]
        for key, values in group.moments.items():
            moments.setdefault(key, {})[name] = values[i]
        scalars[name] = group.scalars[i]
    steps, skipped = int(states.get("global_steps", 0)), int(states.get("skipped_steps", 0))
    common = {
        "format_version": FORMAT_VERSION,
        "param_groups": [group.hyper for group in found.groups],
        "scalar_state": scalars,
        "loss_scaler": _loss_scaler(found, skipped),
        "global_step": steps - skipped,
        "micro_step": steps * _accumulation(states),
        "buffers": {n: module[n] for n in buffer_names if n in module},
        "frozen_params": frozen,
        "client_state": found.client_state() if payload is None else payload,
    }
    meta = CheckpointMetadata(
        format_version=FORMAT_VERSION,
        tag=_TAG,
        world_size=1,
        stage=found.stage,
        global_step=steps - skipped,
        params=tuple(
            ParamRecord(n, tuple(weights[n].shape), g, tuple(aliases.get(n, ())))
            for n, (g, _) in named.items()
        ),
        shards=(),
        optimizer_class="DeepSpeed",
        state_keys=tuple(sorted(moments)),
        state_dict_keys=tuple(module) if module else tuple(named),
        buffer_names=buffer_names,
        frozen_names=tuple(frozen),
    )
    work = Path(tempfile.mkdtemp(prefix="minispeed-deepspeed-"))
    write_one_rank(work, _TAG, meta, common, weights, moments, None)
    return work


def deepspeed_weights(tag_dir: Path) -> Path:
    """DeepSpeed's tag `tag_dir` as a one-rank minispeed checkpoint to consolidate (a new
    temporary directory, tag `"deepspeed"`; the caller removes it). At stage 0 the parameters
    are named in the module's order: exact for an fp32 run (the masters are the module's
    weights, by name); DeepSpeed's bf16/fp16 wrapper keeps its fp32 masters by position only,
    so that case is refused (load it into an engine, whose optimizer names them)."""
    found = read_tag(tag_dir)
    if found.stage == 0:
        if any(m is not None for group in found.groups for m in group.masters):
            raise CheckpointError(
                f"DeepSpeed checkpoint {tag_dir} is a 16-bit run at ZeRO stage 0, whose fp32 "
                "masters carry no parameter names (DeepSpeed's zero_to_fp32 does not read it "
                "either): load it with engine.load_checkpoint, which names them by the "
                "optimizer's groups, then save or consolidate from there"
            )
        buffers = set(found.states.get("buffer_names") or ())
        order = [n for n in found.states["module"] if n not in buffers]
        names, start = [], 0
        for group in found.groups:
            group.moments = {}  # weights only: the masters are taken by name
            names.append(order[start : start + len(group.masters)])
            start += len(group.masters)
        found.name_groups(names)
    return to_zero_checkpoint(found)


@contextlib.contextmanager
def weights_tag_dir(tag_dir: Path) -> Iterator[Path]:
    """The tag directory `zero.consolidate` reads for `tag_dir`: `tag_dir` itself when minispeed
    wrote it; for a tag DeepSpeed wrote, its weights as a one-rank minispeed checkpoint
    (`deepspeed_weights`) in a temporary directory, removed on exit. The one conversion behind
    `minispeed consolidate` and the adapter `zero_to_fp32`."""
    if not is_deepspeed_tag(tag_dir):
        yield tag_dir
        return
    work = deepspeed_weights(tag_dir)
    try:
        yield work / _TAG
    finally:
        shutil.rmtree(work, ignore_errors=True)


def engine_payload(found: DeepSpeedTag) -> dict[str, Any]:
    """The engine's client state (`grid.ENGINE_STATE`: counters, scheduler) from DeepSpeed's
    model-states file, with DeepSpeed's client state beside it."""
    states = found.states
    config = states.get("ds_config") or {}
    steps = int(states.get("global_steps", 0))
    batch = config.get("train_batch_size") or (
        int(config.get("train_micro_batch_size_per_gpu", 1))
        * _accumulation(states)
        * int(states.get("dp_world_size", 1))
    )
    ours = {
        "global_steps": steps,
        "global_samples": int(states.get("global_samples", steps * batch)),
        "skipped_steps": int(states.get("skipped_steps", 0)),
        "micro_steps": steps * _accumulation(states),
        "lr_scheduler": states.get("lr_scheduler"),
        "train_batch_size": batch,
    }
    return {ENGINE_STATE: ours, "client": found.client_state()}


def load_deepspeed(
    part: Any, tag_dir: Path, *, load_optimizer_states: bool, strict: bool, what: str
) -> dict[str, Any] | None:
    """Load DeepSpeed's tag `tag_dir` into this rank's part (collective over the world; any
    data-parallel size); returns `engine_payload`'s (the engine's counters and scheduler, and
    DeepSpeed's client state)."""

    def convert() -> Path:
        if part.place.part is not None:
            raise CheckpointError(
                f"{tag_dir} holds DeepSpeed's files of a data-parallel run; this engine runs a "
                f"grid of {part.place.shape()}: load it into a data-parallel engine (no pipeline, "
                "tensor or expert parallelism)"
            )
        found = read_tag(tag_dir)
        if found.stage == 0:  # positional, in this optimizer's groups
            frags = sorted(part.optimizer.fragments(), key=lambda f: (f.group, f.master_index))
            count = 1 + max((f.group for f in frags), default=-1)
            names = [[f.name for f in frags if f.group == g] for g in range(count)]
            found.name_groups(names)
        return to_zero_checkpoint(found, engine_payload(found))

    work, _ = together(None, what, convert)
    try:
        return zero.load_checkpoint(
            part.optimizer, part.module, work, _TAG,
            load_optimizer_states=load_optimizer_states, strict=strict, load_rng=False,
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
