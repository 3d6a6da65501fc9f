"""What one DeepSpeed tag holds, per parameter, and how its pickles are opened safely.

Shared by the two readers of DeepSpeed's checkpoints: `deepspeed_files.py` (its native ZeRO
layout, flat partitions per rank) and `universal.py` (its universal layout, one folder per
parameter). Both produce a `DeepSpeedTag`, which `deepspeed_files.to_zero_checkpoint` writes as
a one-rank minispeed checkpoint.

Safety: DeepSpeed's files are pickles holding four objects of DeepSpeed's besides tensors
(`ZeroStageEnum`, `LossScaler`, `DynamicLossScaler`, `fragment_address`). They are opened with
`torch.load(weights_only=True)`, which runs no code from the file, with those four names mapped
to the inert stand-ins below (`_DS_GLOBALS`); any other object in the file is refused by torch,
named in the error. So a DeepSpeed checkpoint of unknown origin is as safe to read as a
`weights_only` state dict, and DeepSpeed need not be installed.
"""

from __future__ import annotations

import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from minispeed.zero.checkpoints import CheckpointError

__all__ = [
    "ENGINE_KEYS",
    "MODEL_STATES",
    "DeepSpeedTag",
    "GroupState",
    "check_version",
    "group_hyper",
    "is_per_element",
    "need",
    "open_file",
    "scalar_state",
    "shape_numel",
]

MODEL_STATES = "mp_rank_00_model_states.pt"
# Model-states keys DeepSpeed's load_checkpoint consumes; the rest is its client state.
ENGINE_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size",
               "data_sampler", "random_ltd", "lr_scheduler")  # fmt: skip


# -- opening DeepSpeed's pickles with weights_only=True -------------------------------------------


class _Plain:
    """An inert object that keeps the attributes a pickle gives it (DeepSpeed's loss scalers,
    `fragment_address`): no method of DeepSpeed's runs."""


def _zero_stage(value: int) -> int:
    """DeepSpeed's `ZeroStageEnum(value)`, read as its int."""
    return int(value)


class _LossScaler(_Plain):
    pass


class _DynamicLossScaler(_Plain):
    pass


class _FragmentAddress(_Plain):
    pass


_DS_GLOBALS = [
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def open_file(path: Path) -> dict[str, Any]:
    """One DeepSpeed file, `weights_only` with the stand-ins (module docstring: Safety)."""
    try:
        with torch.serialization.safe_globals(_DS_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln] or [str(e)]
        raise CheckpointError(
            f"DeepSpeed checkpoint file {path} holds an object this reader does not open "
            f"({lines[0]}): it reads DeepSpeed 0.19's ZeRO checkpoints with "
            "weights_only=True and maps only the objects those hold. Convert the checkpoint with "
            "DeepSpeed's zero_to_fp32.py and load the weights, or load it with DeepSpeed"
        ) from e
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(
            f"DeepSpeed checkpoint file {path} cannot be read ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}): it is damaged or cut short; copy it "
            "again from where DeepSpeed wrote it"
        ) from e


def need(saved: dict[str, Any], key: str, path: Path, what: str) -> Any:
    """`saved[key]`, or an error naming the file and what the key is (no KeyError)."""
    if not isinstance(saved, dict) or key not in saved:
        raise CheckpointError(
            f"DeepSpeed checkpoint file {path} has no {key!r} ({what}): this is not a layout "
            "this reader knows (DeepSpeed 0.19's ZeRO checkpoints). Load it with the DeepSpeed "
            "that wrote it, or convert it to fp32 weights with its zero_to_fp32.py"
        )
    return saved[key]


# -- what one tag holds ----------------------------------------------------------------------------


@dataclass
class GroupState:
    """One optimizer param group, joined over the ranks: whole fp32 tensors per parameter."""

    names: list[str] | None  # None at stage 0 (positional: `DeepSpeedTag.name_groups`)
    hyper: dict[str, Any]  # lr, betas, eps, weight_decay, ... (no "params")
    masters: list[torch.Tensor | None]  # fp32, shaped (None: fp32 stage 0, taken by name)
    moments: dict[str, list[torch.Tensor]]  # exp_avg, exp_avg_sq: like `masters`
    scalars: list[dict[str, Any]]  # per parameter: step


@dataclass
class DeepSpeedTag:
    """What `read_tag` found in one DeepSpeed tag directory."""

    tag_dir: Path
    stage: int
    world_size: int  # the data-parallel size that wrote it
    states: dict[str, Any]  # the (rank 0) model-states file
    groups: list[GroupState]
    loss_scaler: dict[str, Any] | None  # DeepSpeed's loss scaler's attributes
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name it shares

    def name_groups(self, names: list[list[str]]) -> None:
        """Stage 0: name the parameters by position (DeepSpeed's own load is positional), from
        the loading optimizer's groups, checking every group's size and every tensor's size. An
        fp32 run's masters are the module's weights, taken here by name."""
        if len(names) != len(self.groups):
            raise CheckpointError(
                f"DeepSpeed checkpoint {self.tag_dir} has {len(self.groups)} optimizer param "
                f"groups, this optimizer {len(names)}: build the optimizer with the groups that "
                "saved it, or pass load_optimizer_states=False"
            )
        module = self.states["module"]
        for g, (group, mine) in enumerate(zip(self.groups, names, strict=True)):
            if len(mine) != len(group.masters):
                raise CheckpointError(
                    f"DeepSpeed checkpoint {self.tag_dir}: param group {g} has "
                    f"{len(group.masters)} parameters there, {len(mine)} here; build the "
                    "optimizer with the groups that saved it"
                )
            group.names = list(mine)
            for i, name in enumerate(mine):
                if group.masters[i] is None:  # fp32: the module's weight is the master
                    group.masters[i] = module[name].float().clone()
                master = group.masters[i]
                for key, values in group.moments.items():
                    if values[i].numel() != master.numel():
                        raise CheckpointError(
                            f"DeepSpeed checkpoint {self.tag_dir}: the optimizer's {key} of "
                            f"parameter {i} of group {g} has {values[i].numel()} elements, the "
                            f"parameter in that place here ({name!r}) {master.numel()}: build "
                            "the optimizer's groups in the order that saved it"
                        )
                    values[i] = values[i].float().reshape(master.shape)

    def named(self) -> dict[str, tuple[int, int]]:
        """{parameter name: (group, index)}."""
        return {n: (g, i) for g, group in enumerate(self.groups) for i, n in enumerate(group.names)}

    def client_state(self) -> dict[str, Any]:
        """What DeepSpeed's `load_checkpoint` returns as client state (with its default flags):
        the model-states keys it does not consume (the caller's among them)."""
        client = {k: v for k, v in self.states.items() if k not in (*ENGINE_KEYS, "optimizer")}
        if self.stage == 0:  # DeepSpeed hands the stage-0 optimizer state back too
            client["optimizer"] = self.states["optimizer"]
        return client


def check_version(states: dict[str, Any], path: Path) -> None:
    version = states.get("ds_version") if isinstance(states, dict) else None
    if not isinstance(version, str) or not re.match(r"^\d+\.\d+", version):
        raise CheckpointError(
            f"DeepSpeed checkpoint file {path} has no readable ds_version ({version!r}): this "
            "reader knows the layout of DeepSpeed 0.19's checkpoints only. Load it with the "
            "DeepSpeed that wrote it, or convert it to fp32 weights with its zero_to_fp32.py"
        )


def is_per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def scalar_state(state: dict[str, Any], per_element: list[str]) -> dict[str, Any]:
    """The scalar state of one parameter (Adam's `step`). DeepSpeed's own Adams keep `step` as
    an int, torch's as a 0-dim fp32 tensor, which every optimizer minispeed steps accepts
    (torch's Adam refuses an int): an int step becomes that tensor."""
    out = {k: v for k, v in state.items() if k not in per_element}
    if isinstance(out.get("step"), int | float):
        out["step"] = torch.tensor(float(out["step"]), dtype=torch.float32)
    return out


def group_hyper(pg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in pg.items() if k != "params"}


def shape_numel(shape: Any) -> int:
    return math.prod(int(d) for d in shape)
