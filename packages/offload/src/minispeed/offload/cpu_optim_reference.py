"""Pure-PyTorch CPU optimizer steps: the specification the C++ kernels are tested against.

Each function follows ``torch.optim``'s single-tensor loop operation by operation (Adam/AdamW:
``torch.optim.adam._single_tensor_adam``; Adagrad: ``_single_tensor_adagrad``), so it gives torch's
bits; Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") has no torch.optim
class and is defined here. The same signatures as `minispeed.offload.cpu_optim`; the wrappers
fall back to these when the op cannot be built. ``simd`` and ``grain`` are accepted and ignored.

Costs per element: the same bytes as the kernels (Adam 28 B, Adagrad and Lion 20 B) plus torch's
temporaries (Adam: ``grad + wd * p``, ``sqrt(v)``, ``denom``: up to 3 x 4 B more traffic).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["adagrad_step", "adam_step", "lion_step"]


def _write_back(params: Sequence[torch.Tensor], write_back: Sequence[torch.Tensor] | None) -> None:
    if write_back is not None:
        for p, out in zip(params, write_back):
            out.copy_(p.view(out.shape))


@torch.no_grad()
def adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    bias_correction: bool = True,
    write_back: Sequence[torch.Tensor] | None = None,
    simd: int | None = None,
    grain: int | None = None,
) -> None:
    """One Adam (L2 weight decay) or AdamW (decoupled) step of every tensor, in place; ``step`` >= 1.
    ``bias_correction=False``: the raw moments (DeepSpeed's switch), both corrections 1."""
    bias_correction1 = 1 - beta1**step if bias_correction else 1.0
    bias_correction2 = 1 - beta2**step if bias_correction else 1.0
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if weight_decay != 0:
            if decoupled_weight_decay:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-step_size)
    _write_back(params, write_back)


@torch.no_grad()
def adagrad_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    state_sums: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    lr_decay: float,
    eps: float,
    weight_decay: float,
    write_back: Sequence[torch.Tensor] | None = None,
    simd: int | None = None,
    grain: int | None = None,
) -> None:
    """One Adagrad step of every tensor, in place; ``step`` >= 1."""
    clr = lr / (1 + (step - 1) * lr_decay)
    for p, g, s in zip(params, grads, state_sums):
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        s.addcmul_(g, g, value=1)
        std = s.sqrt().add_(eps)
        p.addcdiv_(g, std, value=-clr)
    _write_back(params, write_back)


@torch.no_grad()
def lion_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    write_back: Sequence[torch.Tensor] | None = None,
    simd: int | None = None,
    grain: int | None = None,
) -> None:
    """One Lion step: ``p -= lr * (sign(b1 m + (1 - b1) g) + wd p)``; ``m = b2 m + (1 - b2) g``."""
    for p, g, m in zip(params, grads, exp_avgs):
        update = m.mul(beta1).add_(g, alpha=1 - beta1)  # what minispeed.offload.Lion steps by
        p.mul_(1 - lr * weight_decay)
        p.add_(update.sign_(), alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1 - beta2)
    _write_back(params, write_back)
