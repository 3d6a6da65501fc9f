"""The estimator: which ZeRO stages fit a model on N GPUs of M GiB, as a table.

``zero.estimate(175e9, world_size=1024, gpu_memory_gib=80).print()`` prints, per stage, the
per-GPU bytes of parameters, gradients and optimizer states from `formulas.model_state_bytes`
(the paper's formulas), and whether they fit. Model states only: leave room for activations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from minispeed.zero.memory.formulas import (
    GiB,
    ModelStateBytes,
    model_state_bytes,
    optimizer_bytes_per_param,
)

__all__ = ["MemoryEstimate", "estimate"]


def _count_params(model: nn.Module, persistence_threshold: int | None) -> tuple[int, int, int]:
    """(Ψ, Ψ_trainable, Ψ_persistent) of a live model; tied parameters counted once."""
    total = trainable = persistent = 0
    for name, p in model.named_parameters():  # named_parameters() yields a tied parameter once
        n = p.numel()
        if n == 0:
            raise ValueError(
                f"parameter {name!r} holds no elements (released by ZeRO stage 3?); estimate the "
                "model before zero.shard / zero.Init, or pass its parameter count instead"
            )
        total += n
        trainable += n if p.requires_grad else 0
        if persistence_threshold is not None and n <= persistence_threshold:
            persistent += n
    return total, trainable, persistent


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank model-state bytes of each stage for one (model, N, GPU size): the estimator's table."""

    num_params: int
    world_size: int
    gpu_memory_bytes: int | None
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    rows: tuple[ModelStateBytes, ...] = field(default_factory=tuple)

    def fits(self, stage: int) -> bool | None:
        """Whether the stage's model states fit in one GPU's memory (None: no GPU size given)."""
        if self.gpu_memory_bytes is None:
            return None
        return self.row(stage).total <= self.gpu_memory_bytes

    def row(self, stage: int) -> ModelStateBytes:
        """The row of ``stage``."""
        for r in self.rows:
            if r.stage == stage:
                return r
        raise KeyError(
            f"stage {stage} was not estimated; estimated stages: {[r.stage for r in self.rows]}"
        )

    def stages_that_fit(self) -> list[int]:
        """Stages whose model states fit (empty when no GPU size was given)."""
        return [r.stage for r in self.rows if self.fits(r.stage)]

    def as_dicts(self) -> list[dict[str, object]]:
        """The table as plain rows (bytes), e.g. for JSON."""
        return [
            {
                "stage": r.stage,
                "params_bytes": r.params,
                "grads_bytes": r.grads,
                "optimizer_bytes": r.optimizer,
                "total_bytes": r.total,
                "fits": self.fits(r.stage),
            }
            for r in self.rows
        ]

    def __rich__(self):  # rich protocol: print(estimate) with rich renders the table
        from rich.table import Table

        gpu = (
            f", {self.gpu_memory_bytes / GiB:.0f} GiB per GPU"
            if self.gpu_memory_bytes is not None
            else ""
        )
        table = Table(
            title=(
                f"ZeRO model states per GPU: Ψ = {_human_count(self.num_params)} parameters, "
                f"N = {self.world_size}{gpu} (p={self.param_bytes}, g={self.grad_bytes}, "
                f"K={self.optimizer_bytes} bytes/param)"
            ),
            caption="activations, buffers and fragmentation come on top",
        )
        for col in ("stage", "params", "grads", "optimizer", "total", "fits"):
            table.add_column(col, justify="right")
        for r in self.rows:
            fits = self.fits(r.stage)
            mark = "-" if fits is None else ("[green]yes[/]" if fits else "[red]no[/]")
            table.add_row(
                str(r.stage),
                *(_gib(b) for b in (r.params, r.grads, r.optimizer, r.total)),
                mark,
            )
        return table

    def print(self) -> None:
        """Print the table with rich."""
        from rich.console import Console

        Console().print(self)


def estimate(
    model_or_num_params: nn.Module | int | float,
    world_size: int,
    *,
    gpu_memory_gib: float | None = None,
    stages: Sequence[int] = (0, 1, 2, 3),
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int | torch.optim.Optimizer = 12,
    persistence_threshold_numel: int | None = None,
) -> MemoryEstimate:
    """Which ZeRO stages fit: per-rank model-state bytes for a model (or a parameter count).

    ``model_or_num_params``: a live ``nn.Module`` (its unique parameters are counted; frozen
    ones get no gradient or optimizer bytes) or Ψ as a number (``175e9``). ``optimizer_bytes`` is
    K or an optimizer instance to read K from (`optimizer_bytes_per_param`).
    ``persistence_threshold_numel``: for stage 3 with a live model, parameters this small stay whole.
    Example: ``zero.estimate(175e9, world_size=1024, gpu_memory_gib=80).print()``.
    """
    if isinstance(optimizer_bytes, torch.optim.Optimizer):
        optimizer_bytes = optimizer_bytes_per_param(optimizer_bytes)
    if isinstance(model_or_num_params, nn.Module):
        total, trainable, persistent = _count_params(
            model_or_num_params, persistence_threshold_numel
        )
    else:
        if float(model_or_num_params) != int(model_or_num_params) or model_or_num_params < 0:
            raise ValueError(
                f"a parameter count must be a whole number >= 0, got {model_or_num_params}"
            )
        total = trainable = int(model_or_num_params)
        persistent = 0
    rows = tuple(
        model_state_bytes(
            total,
            world_size,
            s,
            param_bytes=param_bytes,
            grad_bytes=grad_bytes,
            optimizer_bytes=optimizer_bytes,
            persistent_params=persistent if s == 3 else 0,
            trainable_params=trainable,
        )
        for s in stages
    )
    return MemoryEstimate(
        num_params=total,
        world_size=world_size,
        gpu_memory_bytes=None if gpu_memory_gib is None else int(gpu_memory_gib * GiB),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        rows=rows,
    )


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f} GiB" if n >= GiB / 100 else f"{n:,} B"


def _human_count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)
