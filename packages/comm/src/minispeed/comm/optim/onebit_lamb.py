"""1-bit LAMB: LAMB's layer-wise trust ratio, with momentum sent in 1 bit after a warm-up.

LAMB scales each tensor's Adam-style update `u = m̂ / (sqrt(v̂) + eps) + wd · p` by a trust
ratio `r = clamp(||p|| / ||u||, min_coeff, max_coeff)`, so every layer moves by a similar
*relative* amount. Two things break once the momentum is compressed (and `v` frozen), and 1-bit
LAMB repairs both:

1. `||u||` would be computed from a compressed momentum, so `r` would follow compression
   noise. Instead `r` is *frozen* to its running average over warm-up
   (`c <- coeff_beta c + (1-coeff_beta) r`), and modulated by a bounded factor (3).
2. One fused buffer carries every tensor's momentum, and 1-bit compression shares one scale per
   chunk; a layer with small momenta would be drowned by a large neighbour. At the freeze each
   tensor gets a fixed multiplier `σ_p = rms(all m) / rms(m_p)` applied before compression and
   removed after (`_average_momenta`).
3. Frozen `v` cannot follow a variance that shrinks later in training. From the averaged
   momenta the optimizer recovers the averaged gradient, `ĝ = (m_t - β1 m_{t-1}) / (1-β1)`,
   keeps a *fresh* `v' <- β2 v' + (1-β2) ĝ²` (started from the bias-corrected frozen `v̂`),
   and multiplies the frozen trust ratio by `f = max_i (sqrt(v̂_i) + eps) / (sqrt(v'_i) + eps)`:
   how much larger the update would be under the fresh variance. `f` is clamped to
   `[factor_min, factor_max]` and may change by at most `factor_threshold` (relative) per
   step, so one noisy `ĝ` cannot jolt the step size.

COMPRESSED step per tensor: `p <- p - lr · c · f · u` with `u` built from the frozen `v`.
Bytes per step: as `OnebitAdam`. Extra memory: `v'` (4 B per
element) and `m_{t-1}` during the step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from minispeed.comm.optim.compressed_momentum import (
    CompressedMomentumOptimizer,
    check_adam_hyperparameters,
)

__all__ = ["OnebitLamb"]


class OnebitLamb(CompressedMomentumOptimizer):
    """LAMB with fp32 warm-up, then frozen variance and trust ratio, and 1-bit momentum.

    Hyper-parameters keep DeepSpeed's names and meanings (`max_coeff`, `min_coeff`,
    `coeff_beta`, `factor_max`, `factor_min`, `factor_threshold`; module docstring).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: int = 100,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        group: Any = None,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        if not 0.0 < min_coeff <= max_coeff:
            raise ValueError(f"need 0 < min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        if not 0.0 < factor_min <= 1.0 <= factor_max:
            raise ValueError(
                f"need 0 < factor_min <= 1 <= factor_max (f = 1 means 'no change'), got "
                f"{factor_min}, {factor_max}"
            )
        if not 0.0 <= coeff_beta < 1.0 or not factor_threshold >= 0.0:
            raise ValueError(
                f"need coeff_beta in [0, 1) and factor_threshold >= 0, got {coeff_beta}, "
                f"{factor_threshold}"
            )
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
            "coeff_beta": coeff_beta,
            "factor_max": factor_max,
            "factor_min": factor_min,
            "factor_threshold": factor_threshold,
        }
        super().__init__(params, defaults, freeze_step=freeze_step, group=group)

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["lamb_coeff"] = None  # running average of the trust ratio (warm-up)
        return state

    @staticmethod
    def _update_direction(
        state: dict[str, Any], p: torch.Tensor, group: dict[str, Any], bc1: float, bc2: float
    ) -> torch.Tensor:
        """`u = m̂ / (sqrt(v̂) + eps) + wd · p` (fp32)."""
        denom = (state["exp_avg_sq"] / bc2).sqrt_().add_(group["eps"])
        u = (state["exp_avg"] / bc1).div_(denom)
        if group["weight_decay"]:
            u.add_(p.float(), alpha=group["weight_decay"])
        return u

    @staticmethod
    def _move(p: torch.Tensor, u: torch.Tensor, step_size: float) -> None:
        if p.dtype == torch.float32:
            p.add_(u, alpha=-step_size)
        else:
            p.copy_(p.float().add_(u, alpha=-step_size))

    def _warmup_update(self, step: int) -> None:
        pairs = self._trainable()
        grads = self._averaged_grads([p for _, p in pairs])
        for (group, p), grad in zip(pairs, grads):
            beta1, beta2 = group["betas"]
            state = self._state(p)
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            u = self._update_direction(state, p, group, 1 - beta1**step, 1 - beta2**step)
            w_norm, u_norm = float(p.float().norm()), float(u.norm())
            trust = 1.0
            if w_norm > 0.0 and u_norm > 0.0:
                trust = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
            coeff = state["lamb_coeff"]
            b = group["coeff_beta"]
            state["lamb_coeff"] = trust if coeff is None else b * coeff + (1 - b) * trust
            self._move(p, u, group["lr"] * trust)

    def _freeze(self) -> None:
        """Fix the momentum multipliers σ_p and start the fresh variance (idempotent: a loaded
        checkpoint keeps the values it saved)."""
        pairs = self._trainable()
        states = [self._state(p) for _, p in pairs]
        sq_sums = [float(s["exp_avg"].pow(2).sum()) for s in states]
        total_numel = sum(p.numel() for _, p in pairs)
        rms_all = (sum(sq_sums) / max(total_numel, 1)) ** 0.5
        for (group, p), state, sq in zip(pairs, states, sq_sums):
            if "momentum_scale" not in state:
                rms_p = (sq / max(p.numel(), 1)) ** 0.5
                state["momentum_scale"] = rms_all / rms_p if rms_p > 0 and rms_all > 0 else 1.0
            if "exp_avg_sq_fresh" not in state:
                # Bias-corrected, so that it compares with the frozen v̂ on equal terms.
                beta2 = group["betas"][1]
                state["exp_avg_sq_fresh"] = state["exp_avg_sq"] / (1 - beta2**self.freeze_step)
            state.setdefault("last_factor", 1.0)
            if state["lamb_coeff"] is None:
                state["lamb_coeff"] = 1.0

    def _compressed_update(self, step: int) -> None:
        pairs = self._trainable()
        states = [self._state(p) for _, p in pairs]
        previous = [s["exp_avg"].clone() for s in states]
        momenta = []
        for (group, p), state in zip(pairs, states):
            beta1, _ = group["betas"]
            momenta.append(state["exp_avg"].lerp_(self._grad_of(p), 1 - beta1))
        self._average_momenta(momenta, [s["momentum_scale"] for s in states])
        for (group, p), state, m_prev in zip(pairs, states, previous):
            beta1, beta2 = group["betas"]
            # The averaged gradient this momentum implies, and the variance it would give.
            grad_avg = (state["exp_avg"] - beta1 * m_prev) / (1 - beta1)
            fresh = (
                state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(grad_avg, grad_avg, value=1 - beta2)
            )
            eps, bc2_frozen = group["eps"], 1 - beta2**self.freeze_step
            ratio = ((state["exp_avg_sq"] / bc2_frozen).sqrt_() + eps) / (fresh.sqrt() + eps)
            factor = min(max(float(ratio.max()), group["factor_min"]), group["factor_max"])
            last, th = state["last_factor"], group["factor_threshold"]
            factor = min(max(factor, last * (1 - th)), last * (1 + th))
            state["last_factor"] = factor
            u = self._update_direction(
                state, p, group, 1 - beta1**step, 1 - beta2**self.freeze_step
            )
            self._move(p, u, group["lr"] * state["lamb_coeff"] * factor)
