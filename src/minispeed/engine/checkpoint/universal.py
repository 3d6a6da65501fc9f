"""DeepSpeed's *universal* checkpoints: read into minispeed, and written from a minispeed one.

A universal checkpoint keeps every parameter whole, one folder per parameter name, so any
data-parallel size and ZeRO stage can take its slice. DeepSpeed 0.19.8 writes one with
`python -m deepspeed.checkpoint.ds_to_universal --input_folder <ckpt>/<tag> --output_folder
<ckpt>/<tag>_universal` and loads it with `"checkpoint": {"load_universal": true}`, which reads
`<ckpt>/latest_universal` instead of `latest`. The layout (DeepSpeed's
`checkpoint/ds_to_universal.py` writes it, `checkpoint/universal_checkpoint.py` and the ZeRO
optimizers' `_load_universal_checkpoint` read it):

```text
<ckpt>/latest_universal                       "<tag>_universal"
<ckpt>/<tag>_universal/
  mp_rank_00_model_states.pt                  stages 0-2: the engine state (deepspeed_files.py)
  zero_pp_rank_<r>_mp_rank_00_model_states.pt stage 3: the same, per rank (rank 0's is read)
  zero/optimizer_state.pt                     the optimizer's global state: `param_groups`
                                              (hyper-parameters per group), `loss_scaler`,
                                              `ds_version`; at stage 3 also rank 0's inner
                                              `optimizer_state_dict` (its `step` is every one's)
  zero/<parameter name>/fp32.pt               the whole fp32 master: `{"param": tensor,
                                              "cat_dim": 0}` (stages 0-2) or the flat tensor
                                              itself (stage 3)
  zero/<parameter name>/exp_avg.pt ...        each per-element optimizer state, the same way
  zero/<parameter name>/step.pt               stages 0-2: the parameter's step (absent at 3)
```

**Reading** (`read_universal`): the names and shapes come from the model states' `param_shapes`
(one `{name: shape}` per param group, in the optimizer's order), the hyper-parameters from
`param_groups`, each tensor from its folder (its element count checked against the shape: a
tensor-parallel universal checkpoint, whose tensors need a tensor rank's cut, is refused by
name). The result is a `deepspeed_files.DeepSpeedTag`, so loading it is the native reader's
path: one one-rank minispeed checkpoint in a temporary directory, re-sliced by
`zero.load_checkpoint` over this engine's ranks at its stage. Every param group keeps its own
hyper-parameters (DeepSpeed's stage-3 universal load gives every group those of group 0).

**Writing** (`write_universal`): a minispeed tag (one part: data parallelism, any stage) read
whole per parameter (`resplit.read_part`), written in the layout above with fp32 tensors as
`{"param": tensor, "cat_dim": 0}` (which DeepSpeed's stages 1-3 all read), the engine state in
both model-states names (so DeepSpeed finds it at stage 3 as well as at 1-2), and
`latest_universal` beside the output folder, as `ds_to_universal` does. Everything is written
into a temporary folder beside the output, each file fsynced, then renamed to the output folder
(the directory fsynced) and `latest_universal` written atomically last: a failure leaves no
output folder and no temporary one. fp16's dynamic loss scale is not carried (DeepSpeed keeps
the one its config starts with).

Cost: reading holds (4 + K)·Ψ bytes (K: optimizer bytes per parameter, 8 for Adam) in host
memory and writes them to the temporary one-rank checkpoint; writing reads every shard of the
tag once, holds (4 + K)·Ψ bytes and writes (4 + K)·Ψ bytes plus one small file per parameter
and state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from minispeed.core.files import atomic_write, fsync_dir
from minispeed.engine.checkpoint.deepspeed_tag import (
    MODEL_STATES,
    DeepSpeedTag,
    GroupState,
    check_version,
    group_hyper,
    need,
    open_file,
    scalar_state,
    shape_numel,
)
from minispeed.engine.checkpoint.grid import ENGINE_STATE, LATEST_UNIVERSAL, read_grid
from minispeed.engine.checkpoint.resplit import read_part
from minispeed.zero.checkpoints import COMMON_FILE, CheckpointError, atomic_save, load_shard

__all__ = [
    "LATEST_UNIVERSAL",
    "is_universal_tag",
    "read_universal",
    "write_universal",
]

ZERO_DIR = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
STAGE3_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
# The DeepSpeed layout written (its universal-checkpoint version, and the ds_version its
# loaders check: stage 1 refuses a checkpoint older than 0.3.17).
DS_VERSION = "0.19.8"
UNIVERSAL_VERSION = 0.4
_WHOLE_KEYS = {"param", "cat_dim"}  # a per-parameter file's keys when its tensor is whole


def is_universal_tag(tag_dir: Path) -> bool:
    """Whether `tag_dir` is a universal checkpoint (it has a `zero/` folder)."""
    return (tag_dir / ZERO_DIR).is_dir()


# -- reading ---------------------------------------------------------------------------------------


def _model_states(tag_dir: Path) -> tuple[dict[str, Any], Path]:
    for name in (MODEL_STATES, STAGE3_STATES):
        if (tag_dir / name).is_file():
            path = tag_dir / name
            states = open_file(path)
            check_version(states, path)
            return states, path
    raise CheckpointError(
        f"universal checkpoint {tag_dir} has neither {MODEL_STATES} nor {STAGE3_STATES}: "
        "ds_to_universal copies it there; copy the whole folder it wrote"
    )


def _whole(path: Path, shape: Any) -> torch.Tensor:
    """The fp32 tensor of one per-parameter file, shaped; refuses a tensor-parallel one."""
    saved = open_file(path)
    if isinstance(saved, dict):
        extra = sorted(set(saved) - _WHOLE_KEYS)
        if extra or saved.get("cat_dim", 0) != 0:
            raise CheckpointError(
                f"universal checkpoint file {path} carries {extra or ['cat_dim']}, the marks of a "
                "tensor-parallel parameter whose whole tensor needs a tensor rank's cut; "
                "minispeed reads data-parallel universal checkpoints only: resume it with "
                "DeepSpeed, or convert the DeepSpeed checkpoint it came from instead"
            )
        saved = need(saved, "param", path, "the whole tensor")
    if not isinstance(saved, torch.Tensor) or saved.numel() != shape_numel(shape):
        got = saved.numel() if isinstance(saved, torch.Tensor) else type(saved).__name__
        raise CheckpointError(
            f"universal checkpoint file {path} holds {got} elements, its parameter's shape "
            f"{tuple(shape)} needs {shape_numel(shape)}: a tensor-parallel slice, or a file of "
            "another model; convert the checkpoint again with ds_to_universal"
        )
    return saved.float().reshape(tuple(shape)).clone()


def read_universal(tag_dir: Path) -> DeepSpeedTag:
    """Every parameter's master, optimizer states and step of a universal checkpoint, by group
    (module docstring); what `deepspeed_files.read_tag` returns for a universal tag."""
    states, states_path = _model_states(tag_dir)
    optim_path = tag_dir / ZERO_DIR / OPTIMIZER_STATE
    if not optim_path.is_file():
        raise CheckpointError(
            f"universal checkpoint {tag_dir} lacks {ZERO_DIR}/{OPTIMIZER_STATE} (the optimizer's "
            "hyper-parameters): ds_to_universal writes it last; convert the checkpoint again"
        )
    optim = open_file(optim_path)
    shapes = need(states, "param_shapes", states_path, "the parameters of each param group")
    param_groups = need(optim, "param_groups", optim_path, "the optimizer's param groups")
    if len(shapes) != len(param_groups):
        raise CheckpointError(
            f"universal checkpoint {tag_dir}: {states_path.name} names {len(shapes)} param "
            f"groups, {OPTIMIZER_STATE} {len(param_groups)}; the two files are of different saves"
        )
    stage = int(optim.get("zero_stage", 3 if "fp32_flat_groups" in optim else 1))
    # Stage 3 keeps no step per parameter: DeepSpeed takes rank 0's first flat group's.
    inner = optim.get("optimizer_state_dict") or {}
    shared_step = (inner.get("state") or {}).get(0, {}).get("step")
    groups = []
    for g, named in enumerate(shapes):
        masters, moments, scalars = [], {}, []
        for name, shape in named.items():
            folder = tag_dir / ZERO_DIR / name
            files = {p.stem: p for p in folder.glob("*.pt")} if folder.is_dir() else {}
            if "fp32" not in files:
                raise CheckpointError(
                    f"universal checkpoint {tag_dir} has no {ZERO_DIR}/{name}/fp32.pt (parameter "
                    f"{name!r}'s master): the conversion was cut short; convert it again"
                )
            masters.append(_whole(files.pop("fp32"), shape))
            step = open_file(files.pop("step")) if "step" in files else shared_step
            for key in sorted(files):
                moments.setdefault(key, []).append(_whole(files[key], shape))
            scalars.append(scalar_state({} if step is None else {"step": step}, []))
        short = [k for k, v in moments.items() if len(v) != len(masters)]
        if short:
            raise CheckpointError(
                f"universal checkpoint {tag_dir}: only some parameters of param group {g} have "
                f"{short[0]}.pt; the conversion was cut short, convert the checkpoint again"
            )
        groups.append(
            GroupState(list(named), group_hyper(param_groups[g]), masters, moments, scalars)
        )
    # ds_to_universal writes fp32.pt for every module tensor without optimizer state: the
    # frozen weights (whole, where stage 3's module holds empty ones) and the buffers (kept
    # as the module has them, in their own dtype).
    kept = {n for named in shapes for n in named} | set(states.get("buffer_names") or ())
    module = dict(states.get("module") or {})
    frozen_shapes = states.get("frozen_param_shapes") or {}
    for name in module:
        path = tag_dir / ZERO_DIR / name / "fp32.pt"
        if name not in kept and path.is_file():
            module[name] = _whole(path, frozen_shapes.get(name, module[name].shape))
    scaler = optim.get("loss_scaler")
    return DeepSpeedTag(
        tag_dir, stage, int(states.get("dp_world_size", 1)), {**states, "module": module},
        groups, None if scaler is None else dict(vars(scaler)),
        dict(states.get("shared_params") or {}),
    )  # fmt: skip


# -- writing ---------------------------------------------------------------------------------------


def _engine_states(common: dict[str, Any], meta: Any, weights: dict[str, torch.Tensor]) -> dict:
    """DeepSpeed's model-states file from a minispeed tag's `common.pt` (counters, scheduler,
    the caller's client state at the top level, as DeepSpeed keeps it)."""
    payload = common.get("client_state") or {}
    ours = payload.get(ENGINE_STATE) or {}
    steps = int(ours.get("global_steps", common.get("global_step", 0)))
    groups = 1 + max((p.group for p in meta.params), default=-1)
    shapes = [{p.name: torch.Size(p.shape) for p in meta.params if p.group == g}
              for g in range(groups)]  # fmt: skip
    module = {n: t.view(_shape(meta, n)) for n, t in weights.items()}
    module |= dict(common.get("frozen_params") or {}) | dict(common.get("buffers") or {})
    client = payload.get("client") if ENGINE_STATE in payload else payload
    # The two ds_config keys a reader of DeepSpeed's files takes its counters from (DeepSpeed
    # stores its whole config): the micro-batches per step keep the accumulation boundary.
    micro = int(ours.get("micro_steps", common.get("micro_step", steps)))
    config = {"gradient_accumulation_steps": micro // steps if steps else 1}
    if "train_batch_size" in ours:
        config["train_batch_size"] = int(ours["train_batch_size"])
    return {
        **(client or {}),
        "module": {n: module[n] for n in meta.state_dict_keys if n in module} or module,
        "buffer_names": list(meta.buffer_names),
        "param_shapes": shapes,
        "frozen_param_shapes": {n: t.shape for n, t in (common.get("frozen_params") or {}).items()},
        "shared_params": {a: p.name for p in meta.params for a in p.aliases},
        "lr_scheduler": ours.get("lr_scheduler"),
        "global_steps": steps,
        "global_samples": int(ours.get("global_samples", 0)),
        "skipped_steps": int(ours.get("skipped_steps", 0)),
        "dp_world_size": meta.world_size,
        "mp_world_size": 1,
        "ds_version": DS_VERSION,
        "ds_config": config,
        "universal_checkpoint_info": {"universal_checkpoint_version": UNIVERSAL_VERSION},
    }


def _shape(meta: Any, name: str) -> tuple[int, ...]:
    return next(tuple(p.shape) for p in meta.params if p.name == name)


def _optimizer_state(common: dict[str, Any], meta: Any, step: Any) -> dict[str, Any]:
    """`zero/optimizer_state.pt`: the param groups (parameter indices as DeepSpeed numbers
    them), and the inner state dict DeepSpeed's stage-3 loader takes the step from."""
    groups, start = [], 0
    for g, hyper in enumerate(common["param_groups"]):
        count = sum(1 for p in meta.params if p.group == g)
        groups.append({**hyper, "params": list(range(start, start + count))})
        start += count
    state = {} if step is None else {0: {"step": step}}
    return {
        "zero_stage": meta.stage,
        "partition_count": meta.world_size,
        "ds_version": DS_VERSION,
        "param_groups": groups,
        "optimizer_state_dict": {"state": state, "param_groups": groups},
    }


def write_universal(tag_dir: Path, out: Path) -> Path:
    """Write the minispeed tag `tag_dir` as a DeepSpeed universal checkpoint folder `out`, and
    `out.parent/latest_universal` naming it (module docstring); returns `out`. Refuses a
    checkpoint of several parts (pipeline, tensor or expert parallel) and an existing `out`."""
    grid = read_grid(tag_dir)
    shape = (grid or {}).get("grid", {})
    if any(shape.get(axis, 1) > 1 for axis in ("pipe", "tensor", "expert")):
        raise CheckpointError(
            f"checkpoint {tag_dir} was saved by a grid of {shape}: only a data-parallel "
            "checkpoint (one part) converts to a universal checkpoint; DeepSpeed's universal "
            "layout for pipeline and tensor parallelism needs Megatron's metadata"
        )
    if out.exists():
        raise CheckpointError(
            f"{out} exists: the universal checkpoint is written as a new folder; remove it or "
            "name another"
        )
    meta, weights, moments, _ = read_part(tag_dir, True)
    common = load_shard(tag_dir / COMMON_FILE, meta.tag, weights_only=False)
    scalar_state = common.get("scalar_state") or {}
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        zero_dir = work / ZERO_DIR
        step = None
        for p in meta.params:
            folder = zero_dir / p.name
            folder.mkdir(parents=True)
            atomic_save({"param": weights[p.name].view(p.shape), "cat_dim": 0}, folder / "fp32.pt")
            for key, flats in moments.items():
                atomic_save({"param": flats[p.name].view(p.shape), "cat_dim": 0},
                            folder / f"{key}.pt")  # fmt: skip
            step = (scalar_state.get(p.name) or {}).get("step", step)
            if "step" in (scalar_state.get(p.name) or {}):
                atomic_save(scalar_state[p.name]["step"], folder / "step.pt")
        for name, t in (common.get("frozen_params") or {}).items():
            (zero_dir / name).mkdir(parents=True)
            atomic_save({"param": t.float(), "cat_dim": 0}, zero_dir / name / "fp32.pt")
        atomic_save(_optimizer_state(common, meta, step), zero_dir / OPTIMIZER_STATE)
        states = _engine_states(common, meta, weights)
        for name in (MODEL_STATES, STAGE3_STATES):
            atomic_save(states, work / name)
        for folder in (*zero_dir.iterdir(), zero_dir, work):
            if folder.is_dir():
                fsync_dir(folder)
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    atomic_write(out.parent / LATEST_UNIVERSAL, out.name)
    return out
