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

from collections.abc import Iterable
from typing import Any

import torch

from minispeed.comm.optim.compressed_momentum import (
    CompressedMomentumOptimizer,
    check_adam_hyperparameters,
)

__all__ = ["OnebitAdam"]


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

    @staticmethod
    def _apply(
        p: torch.Tensor, exp_avg: torch.Tensor, denom: torch.Tensor, lr: float, bc1: float
    ) -> None:
        # The operation order of torch.optim.Adam (single-tensor path), so warm-up matches it.
        if p.dtype == torch.float32:
            p.addcdiv_(exp_avg, denom, value=-lr / bc1)
        else:
            p.copy_(p.float().addcdiv_(exp_avg, denom, value=-lr / bc1))

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
            bc2_sqrt = (1 - beta2**step) ** 0.5
            denom = (state["exp_avg_sq"].sqrt() / bc2_sqrt).add_(group["eps"])
            self._apply(p, state["exp_avg"], denom, group["lr"], 1 - beta1**step)

    def _compressed_update(self, step: int) -> None:
        pairs = self._trainable()
        momenta = []
        for group, p in pairs:
            beta1, _ = group["betas"]
            grad = self._grad_of(p)
            if group["weight_decay"]:
                grad = grad.add(p.float(), alpha=group["weight_decay"])
            momenta.append(self._state(p)["exp_avg"].lerp_(grad, 1 - beta1))
        self._average_momenta(momenta)
        for group, p in pairs:
            beta1, beta2 = group["betas"]
            state = self._state(p)
            bc2_sqrt = (1 - beta2**self.freeze_step) ** 0.5  # frozen with v
            denom = (state["exp_avg_sq"].sqrt() / bc2_sqrt).add_(group["eps"])
            self._apply(p, state["exp_avg"], denom, group["lr"], 1 - beta1**step)
