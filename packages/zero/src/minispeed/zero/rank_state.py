"""`ZeroOptimizer.state_dict` / `load_state_dict`: one rank's optimizer state, in memory.

What DeepSpeed's ZeRO optimizer's `state_dict` gives: this rank's partition, for a resume on the
same rank of the same layout (same world size, stage and parameters). It holds

- ``inner``: the inner optimizer's `state_dict` (torch.optim's format: per-master state such
  as Adam's ``exp_avg``/``exp_avg_sq``/``step``, and every param group's hyper-parameters, so a
  scheduler's ``initial_lr`` and current ``lr`` come back too);
- ``masters``: this rank's fp32 masters, as CPU copies (bf16/fp16 training keeps them apart from
  the model's 16-bit parameters; ZeRO-Infinity keeps them only in its files);
- ``loss_scaler``, ``global_step``, ``micro_step`` and the ``layout`` it was taken from.

Bytes: Ψ/N·4 of master copies plus the inner state (Ψ/N·K); the inner state tensors are
references to the live ones where the optimizer keeps them in memory (as torch.optim's
`state_dict` does: `copy.deepcopy` it to keep it while training goes on), copies read from the
files where offload keeps them there. To move between world sizes or stages, or to write files,
use `zero.save_checkpoint` / `zero.load_checkpoint` instead.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["load_rank_masters", "load_rank_state_dict", "rank_state_dict"]

_FORMAT = "minispeed.zero.rank_state/1"


def _layout(opt: Any) -> dict[str, Any]:
    import minispeed.comm as comm

    return {
        "stage": opt.config.stage,
        "world_size": comm.get_world_size(opt.comm_group),
        "rank": comm.get_rank(opt.comm_group),
        "fragments": [(f.name, f.start, f.numel) for f in opt.fragments()],
    }


def _masters_in_memory(inner: Any) -> contextlib.AbstractContextManager[Any]:
    """ZeRO-Infinity's optimizer keeps masters and states in files: bring them into its param
    groups and `state` for the duration (12 B per element); other optimizers hold them already."""
    if getattr(inner, "masters_in_files", False):
        return inner.states_in_memory()
    return contextlib.nullcontext()


@torch.no_grad()
def rank_state_dict(opt: Any) -> dict[str, Any]:
    """This rank's state of the `ZeroOptimizer` ``opt`` (see the module docstring). Local."""
    inner = opt.optimizer
    with _masters_in_memory(inner):
        masters = [
            [m.detach().to("cpu", copy=True) for m in pg["params"]] for pg in inner.param_groups
        ]
        if getattr(inner, "masters_in_files", False):  # already materialised: torch's own
            state = torch.optim.Optimizer.state_dict(inner)
        else:
            state = inner.state_dict()
    return {
        "format": _FORMAT,
        "layout": _layout(opt),
        "inner": state,
        "masters": masters,
        "loss_scaler": opt.loss_scaler.state_dict(),
        "global_step": opt.global_step,
        "micro_step": opt.micro_step,
    }


@torch.no_grad()
def load_rank_state_dict(opt: Any, saved: dict[str, Any], *, masters_only: bool = False) -> None:
    """Restore `rank_state_dict`'s output into ``opt``, then publish the masters into the model
    (`masters_only`: the masters alone, as `load_rank_masters`).

    Collective (the publish: an all-gather at stages 1-2, the shard writes and agreement of
    stage 3). A state from another layout is refused, naming both and the fix. The param-group
    dicts keep their identity (a scheduler, and under offload the user's optimizer, hold them).
    """
    if masters_only:
        load_rank_masters(opt, saved)
        return
    _check_layout(opt, saved, "load_state_dict")
    inner = opt.optimizer
    groups = list(inner.param_groups)  # the dicts themselves: torch's load replaces them
    with _masters_in_memory(inner):
        _copy_masters(inner, saved)
        if getattr(inner, "masters_in_files", False):
            torch.optim.Optimizer.load_state_dict(inner, saved["inner"])
        else:
            inner.load_state_dict(saved["inner"])
    for old, new in zip(groups, inner.param_groups, strict=True):
        if old is not new:
            old.clear()
            old.update(new)
    inner.param_groups = groups
    opt.loss_scaler.load_state_dict(saved["loss_scaler"])
    opt.global_step = saved["global_step"]
    opt.micro_step = saved["micro_step"]
    opt.strategy.zero_grad()
    opt.strategy.publish_params()


def load_rank_masters(opt: Any, saved: dict[str, Any]) -> None:
    """Only the fp32 masters of `rank_state_dict`'s output into ``opt``, then published into the
    model (collective, as `load_rank_state_dict`); the optimizer state, loss scale and counters
    stay as they are. Same layout check."""
    _check_layout(opt, saved, "load_state_dict")
    with torch.no_grad(), _masters_in_memory(opt.optimizer):
        _copy_masters(opt.optimizer, saved)
    opt.strategy.publish_params()


def _check_layout(opt: Any, saved: Any, call: str) -> None:
    if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
        raise ValueError(
            f"ZeroOptimizer.{call} expects what ZeroOptimizer.state_dict() returned on "
            f"this rank (format {_FORMAT!r}); for a zero.save_checkpoint directory use "
            "zero.load_checkpoint"
        )
    here = _layout(opt)
    if saved["layout"] != here:
        diff = [k for k in here if saved["layout"].get(k) != here[k]]
        raise ValueError(
            f"ZeroOptimizer.{call}: the state was taken with a different {diff} "
            f"(saved stage {saved['layout']['stage']}, rank {saved['layout']['rank']} of "
            f"{saved['layout']['world_size']}; here stage {here['stage']}, rank {here['rank']} of "
            f"{here['world_size']}); load each rank's own state into the same model and config, "
            "or use zero.save_checkpoint / zero.load_checkpoint to change the layout"
        )


def _copy_masters(inner: Any, saved: dict[str, Any]) -> None:
    for pg, ms in zip(inner.param_groups, saved["masters"], strict=True):
        for m, value in zip(pg["params"], ms, strict=True):
            m.copy_(value)
