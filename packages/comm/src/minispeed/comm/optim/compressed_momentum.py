"""The skeleton shared by 1-bit Adam and 1-bit LAMB: warm up exactly, then send momentum in 1 bit.

Both optimizers run in two phases (`OnebitPhase`):

1. **WARMUP** (steps `1 .. freeze_step`): gradients are averaged over the group with one fp32
   all-reduce of a flat buffer (`2(n-1)/n · 4Ψ` bytes per rank, Ψ = trainable elements) and the
   optimizer runs its full-precision rule, building its second moment `v`.
2. **COMPRESSED** (after `freeze_step`): `v` is frozen. Each rank folds its *local* gradient
   into its momentum, and the momenta are averaged with `OnebitAllReduce` (worker and server error feedback): `2(n-1)(4 + C/8)` bytes with
   `C ≈ Ψ/n`, i.e. about `(n-1)/n · Ψ/4` per rank instead of `(n-1)/n · 8Ψ`: ~32x fewer.

**Note [why freezing v makes momentum compressible]**

Adam's update `m / sqrt(v)` is non-linear in the gradients, so averaging compressed
gradients would feed compression noise into `v` (whose square amplifies it). Once `v`
stops changing (after warm-up it varies slowly), the update is *linear* in `m`: averaging
the ranks' momenta is the same as building momentum from the averaged gradient, and
compression error in `m` is corrected by error feedback over the next steps.

Use without DDP: the optimizer communicates itself. Call `loss.backward()` on every rank, then
`step()`. Parameters whose `.grad` is `None` on a rank count as zero gradients, so every
rank's flat buffer has the same layout. Memory beyond the optimizer's own state: the two
residuals of the 1-bit all-reduce (`≈ 4Ψ + 4Ψ/n` bytes).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

import torch

from minispeed.comm import collectives, groups
from minispeed.comm.compression import OnebitAllReduce

__all__ = ["CompressedMomentumOptimizer", "OnebitPhase", "OnebitSchedule", "OnebitScheduled"]


class OnebitPhase(enum.Enum):
    """Where a 1-bit optimizer is in its schedule (module docstring). A state of `OnebitSchedule`,
    changed only by its asserting `to_compressed` / `to_warmup`.

    WARMUP: fp32 gradient all-reduce; state per parameter: `exp_avg`, `exp_avg_sq` (4 B each
    per element). COMPRESSED: 1-bit momentum all-reduce; the same state, `exp_avg_sq` frozen,
    plus the all-reduce's residuals (≈ 4 B per element).

    Transitions: WARMUP -> COMPRESSED after `freeze_step` steps (the optimizer runs its freeze
    first), COMPRESSED -> WARMUP only when a checkpoint from before the freeze is loaded into a
    plain 1-bit optimizer (zero's refuses it: its gradient reduction cannot be switched back on).
    """

    WARMUP = "warmup"
    COMPRESSED = "compressed"


class OnebitSchedule:
    """The one owner of a 1-bit optimizer's `OnebitPhase`: warm-up for `freeze_step` steps, then
    compressed. Both 1-bit optimizers hold one (`CompressedMomentumOptimizer` here, zero's
    `OnebitZeroOptimizer` for 1-bit Adam under ZeRO), ask it whether a step ends the warm-up,
    and move it only through `to_compressed` / `to_warmup`, which assert the legal source phase.
    """

    def __init__(self, freeze_step: int) -> None:
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(
                f"freeze_step must be a positive int (warm-up steps in full precision), got "
                f"{freeze_step!r}"
            )
        self.freeze_step = freeze_step
        self._phase = OnebitPhase.WARMUP

    @property
    def phase(self) -> OnebitPhase:
        """WARMUP or COMPRESSED (read-only: see `OnebitPhase` for the transitions)."""
        return self._phase

    def ends_warmup(self, steps_taken: int) -> bool:
        """Whether the optimizer, having taken `steps_taken` steps, must freeze now."""
        return self._phase is OnebitPhase.WARMUP and steps_taken >= self.freeze_step

    def to_compressed(self) -> None:
        """WARMUP -> COMPRESSED, after the optimizer's freeze."""
        assert self._phase is OnebitPhase.WARMUP, f"cannot enter COMPRESSED from {self._phase}"
        self._phase = OnebitPhase.COMPRESSED

    def to_warmup(self) -> None:
        """COMPRESSED -> WARMUP: a checkpoint from before the freeze was loaded (plain 1-bit
        optimizers only: their gradient all-reduce resumes)."""
        assert self._phase is OnebitPhase.COMPRESSED, f"cannot rewind to WARMUP from {self._phase}"
        self._phase = OnebitPhase.WARMUP


class OnebitScheduled:
    """What a 1-bit optimizer shows of its `OnebitSchedule` (``self.schedule``): the phase and
    the freeze step, read-only. The base of both 1-bit optimizers (here and zero's)."""

    schedule: OnebitSchedule

    @property
    def phase(self) -> OnebitPhase:
        """WARMUP or COMPRESSED (`OnebitSchedule`)."""
        return self.schedule.phase

    @property
    def freeze_step(self) -> int:
        """Warm-up steps (optimizer steps taken in full precision) before the freeze."""
        return self.schedule.freeze_step


def check_adam_hyperparameters(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
    """Raise a ValueError naming the bad value for the hyper-parameters Adam and LAMB share."""
    if not lr > 0.0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas must be two values in [0, 1), got {betas}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0 (it keeps the update finite where v = 0), got {eps}")
    if weight_decay < 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")


class CompressedMomentumOptimizer(OnebitScheduled, torch.optim.Optimizer):
    """Base class: phases, the flat gradient/momentum collectives, checkpoint handling.

    Subclasses implement `_warmup_update` (gradients already averaged) and
    `_compressed_update` (momenta to be averaged with `_average_momenta`).
    """

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        freeze_step: int,
        group: Any = None,
    ) -> None:
        self.schedule = OnebitSchedule(freeze_step)  # checked before anything is built
        super().__init__(params, defaults)
        self.group = group
        self.steps_taken = 0
        self.momentum_allreduce = OnebitAllReduce(group=group)

    def _freeze(self) -> None:
        """Hook at the end of warm-up (e.g. record coefficients). Default: nothing."""

    # -- helpers for subclasses ------------------------------------------------------------------
    def _trainable(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """(param group, parameter) for every parameter that requires grad, in a fixed order."""
        return [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]

    @staticmethod
    def _grad_of(p: torch.Tensor) -> torch.Tensor:
        """The parameter's gradient as fp32 (zeros where it has none)."""
        if p.grad is None:
            return torch.zeros_like(p, dtype=torch.float32)
        if p.grad.is_sparse:
            raise RuntimeError("1-bit optimizers do not support sparse gradients; use dense ones")
        return p.grad.detach().to(torch.float32)

    def _averaged_grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every parameter's gradient averaged over the group: one fp32 all-reduce of Ψ elements."""
        grads = [self._grad_of(p) for p in params]
        if not grads:
            return []
        flat = torch.cat([g.reshape(-1) for g in grads])
        if groups.is_initialized():
            collectives.all_reduce(flat, group=self.group)
            flat.div_(groups.get_world_size(self.group))
        return [chunk.view_as(g) for chunk, g in zip(flat.split([g.numel() for g in grads]), grads)]

    def _average_momenta(
        self, momenta: list[torch.Tensor], scales: list[float] | None = None
    ) -> None:
        """Average `momenta` over the group in place with the 1-bit all-reduce.

        `scales` multiply each tensor before compression and divide it after, so tensors of
        different magnitude share the fused buffer's chunk scales fairly (1-bit LAMB uses it).
        """
        if not momenta:
            return
        scales = scales or [1.0] * len(momenta)
        flat = torch.cat([m.reshape(-1) * s for m, s in zip(momenta, scales)])
        if groups.is_initialized():
            self.momentum_allreduce(flat)
        for m, chunk, s in zip(momenta, flat.split([m.numel() for m in momenta]), scales):
            m.copy_(chunk.view_as(m) / s)

    # -- the step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One optimizer step on every rank (collectives inside: call it on all ranks)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.steps_taken += 1
        if self.phase is OnebitPhase.WARMUP:
            self._warmup_update(self.steps_taken)
            if self.schedule.ends_warmup(self.steps_taken):
                self._freeze()
                self.schedule.to_compressed()
        else:
            self._compressed_update(self.steps_taken)
        return loss

    def _warmup_update(self, step: int) -> None:
        raise NotImplementedError

    def _compressed_update(self, step: int) -> None:
        raise NotImplementedError

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus the step count (residuals are not saved; see below)."""
        state = super().state_dict()
        state["onebit"] = {"steps_taken": self.steps_taken, "freeze_step": self.freeze_step}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore state and the phase the restored step count implies (a checkpoint from before
        the freeze rewinds a compressed optimizer to warm-up). The 1-bit residuals restart at
        zero: they are bounded corrections (Note [why error feedback bounds the accumulated
        error]), and their size depends on the world size, which may differ after a restart.
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop("onebit", None)
        if extra is None:
            raise ValueError(
                "state_dict has no 'onebit' entry: it was not saved by a 1-bit optimizer; load "
                "a state_dict produced by this optimizer's state_dict()"
            )
        super().load_state_dict(state_dict)
        self.steps_taken = int(extra["steps_taken"])
        if self.steps_taken < self.freeze_step:
            if self.phase is OnebitPhase.COMPRESSED:
                self.schedule.to_warmup()
        else:
            self._freeze()  # idempotent: the values the checkpoint saved are kept
            if self.phase is OnebitPhase.WARMUP:
                self.schedule.to_compressed()
        self.momentum_allreduce.reset()
