"""1-bit Adam: Adam whose momentum, not its gradient, is communicated in 1 bit after a warm-up.

Per parameter, with g the gradient (plus `weight_decay * p`, as `torch.optim.Adam`'s L2),
β1, β2 the betas and t the step:

WARMUP (t <= freeze_step), `g` averaged over ranks in fp32 — exactly `torch.optim.Adam`:

```text
m <- β1 m + (1-β1) g          v <- β2 v + (1-β2) g²
p <- p - lr · (m / (1-β1^t)) / (sqrt(v / (1-β2^t)) + eps)
```

COMPRESSED (t > freeze_step), `g` local to this rank, `v` and its bias correction frozen at
`t0 = freeze_step` (Note [why freezing v makes momentum compressible]):

```text
m <- onebit_average(β1 m + (1-β1) g)        (all ranks end with the same m)
p <- p - lr · (m / (1-β1^t)) / (sqrt(v / (1-β2^t0)) + eps)
```

Bytes per step per rank (Ψ trainable elements, n ranks): warm-up `2(n-1)/n · 4Ψ`; compressed
`2(n-1)(4 + C/8)`, `C = 8 ceil(Ψ / 8n)` (`minispeed.comm.compression.wire.onebit_allreduce_calls`). Memory: Adam's `8Ψ` bytes of state plus `≈ 4Ψ (1 + 1/n)` for the
error-feedback residuals once compressed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from minispeed.comm.optim.compressed_momentum import (
    CompressedMomentumOptimizer,
    check_adam_hyperparameters,
)

__all__ = ["OnebitAdam", "adam_update_", "fold_gradient_"]


def fold_gradient_(
    exp_avg: torch.Tensor,
    grad: torch.Tensor,
    group: dict[str, Any],
    param_fp32: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """`m <- β1 m + (1-β1)(g + wd·p)` in place (L2 as `torch.optim.Adam`; `param_fp32()` is
    read only when `weight_decay > 0`); returns `m`. The compressed phase's momentum update,
    here and in zero's 1-bit Adam (`minispeed.zero.onebit`)."""
    if group["weight_decay"]:
        grad = grad.add(param_fp32(), alpha=group["weight_decay"])
    return exp_avg.lerp_(grad, 1 - group["betas"][0])


def adam_update_(
    p: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    group: dict[str, Any],
    step: int,
    variance_step: int,
) -> None:
    """`p <- p - lr · (m / (1-β1^step)) / (sqrt(v / (1-β2^variance_step)) + eps)`, in the
    operation order of `torch.optim.Adam` (single-tensor path), so warm-up matches it. Warm-up:
    `variance_step = step`; compressed: `variance_step = freeze_step` (v frozen with its bias
    correction). A 16-bit `p` is updated through an fp32 copy. Used here and by zero's 1-bit
    Adam, which steps its fp32 master shards with it."""
    beta1, beta2 = group["betas"]
    denom = (exp_avg_sq.sqrt() / (1 - beta2**variance_step) ** 0.5).add_(group["eps"])
    value = -group["lr"] / (1 - beta1**step)
    if p.dtype == torch.float32:
        p.addcdiv_(exp_avg, denom, value=value)
    else:
        p.copy_(p.float().addcdiv_(exp_avg, denom, value=value))


class OnebitAdam(CompressedMomentumOptimizer):
    """Adam with fp32 warm-up, then frozen variance and 1-bit momentum averaging (module docstring).

    `freeze_step`: warm-up steps (DeepSpeed's `freeze_step`; 1-bit Adam's paper uses ~15-25 %
    of training). `group`: the data-parallel process group (`None`: every rank).
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
        group: Any = None,
    ) -> None:
        check_adam_hyperparameters(lr, betas, eps, weight_decay)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults, freeze_step=freeze_step, group=group)

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        return state

    def _warmup_update(self, step: int) -> None:
        pairs = self._trainable()
        grads = self._averaged_grads([p for _, p in pairs])
        for (group, p), grad in zip(pairs, grads):
            beta1, beta2 = group["betas"]
            state = self._state(p)
            if group["weight_decay"]:
                grad = grad.add(p.float(), alpha=group["weight_decay"])
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            adam_update_(p, state["exp_avg"], state["exp_avg_sq"], group, step, step)

    def _compressed_update(self, step: int) -> None:
        pairs = self._trainable()
        momenta = [
            fold_gradient_(self._state(p)["exp_avg"], self._grad_of(p), group, p.float)
            for group, p in pairs
        ]
        self._average_momenta(momenta)
        for group, p in pairs:
            state = self._state(p)
            adam_update_(p, state["exp_avg"], state["exp_avg_sq"], group, step, self.freeze_step)
