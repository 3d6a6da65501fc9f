"""Fake quantization with a straight-through gradient, and the top-k mask: the math of QAT and
pruning, in pure PyTorch (docs/packages/compression.md).

A fake quantizer rounds a tensor to `2**bits` levels and returns it in its own dtype: the
forward sees the rounding error, the backward passes the gradient through unchanged (the
straight-through estimator), so the fp32 master weights keep learning below the grid's step.

```python
from minispeed.compression.quantize import fake_quantize, top_k_mask
w_q = fake_quantize(w, bits=8, symmetric=True, groups=4)   # same shape and dtype as w
m = top_k_mask(scores, dense_ratio=0.5)                     # 1.0 on the top half, else 0.0
```

Symmetric, per group g of the flattened tensor: `scale = 2·max|x_g| / 2**bits`,
`q = clamp(round(x / scale), -2**(bits-1), 2**(bits-1) - 1) · scale`. Asymmetric:
`scale = (max x_g - min x_g) / 2**bits`, `z = round(min x_g / scale) · scale`,
`q = clamp(round((x - z) / scale), 0, 2**bits - 1) · scale + z`. 2 bits is ternary
(`±α` or 0, threshold 0.7·mean|x_g|), 1 bit binary (`sign(x) · mean|x_g|`).

Cost per call on a tensor of n elements: ~6 elementwise passes (n FLOPs each: divide, round,
clamp, multiply, plus the reduction for the range), and one transient copy of n elements; the
model keeps nothing extra (scales are recomputed every forward).
"""

from __future__ import annotations

import math

import torch

__all__ = ["fake_quantize", "quantize_reference", "top_k_mask"]


def quantize_reference(
    x: torch.Tensor,
    bits: int,
    symmetric: bool = True,
    groups: int = 1,
    value_range: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`x` rounded to `2**bits` levels per group of its flattened elements (no gradient rule).

    `value_range`: a fixed `(min, max)` (static activation ranges; then `groups` must be 1)
    instead of each group's own. `groups` must divide `x.numel()`.
    """
    if x.numel() % groups:
        raise ValueError(
            f"quantize_groups={groups} does not divide a tensor of {x.numel()} elements "
            f"(shape {tuple(x.shape)}); give a divisor of every compressed weight's size"
        )
    if bits <= 2:
        if value_range is not None or not symmetric:
            raise ValueError(f"{bits}-bit quantization is symmetric with its own range only")
        return _ternary(x, groups) if bits == 2 else _binary(x, groups)
    levels = 2**bits
    flat = x.reshape(groups, -1)
    if symmetric:
        if value_range is None:
            peak = flat.abs().amax(dim=-1).view(groups, -1)
        else:
            low, high = value_range
            peak = torch.max(low.abs(), high).view(-1)
        scale = 2 * peak / levels
        q = (flat / scale).round().clamp(-levels // 2, levels // 2 - 1) * scale
    else:
        if value_range is None:
            low, high = flat.amin(dim=-1, keepdim=True), flat.amax(dim=-1, keepdim=True)
        else:
            low, high = value_range
        scale = (high - low) / levels
        zero = (low / scale).round() * scale
        q = ((flat - zero) / scale).round().clamp(0, levels - 1) * scale + zero
    return q.reshape(x.shape).contiguous()


def _ternary(x: torch.Tensor, groups: int) -> torch.Tensor:
    flat = x.reshape(groups, -1)
    threshold = (0.7 * flat.norm(p=1, dim=1).div(flat.shape[1])).view(-1, 1)
    kept = (flat.abs() > threshold).to(x.dtype)
    alpha = ((kept * flat).abs().sum(dim=1) / kept.sum(dim=1)).view(-1, 1)
    out = alpha * (flat > threshold).to(x.dtype) - alpha * (flat < -threshold).to(x.dtype)
    return out.reshape(x.shape).contiguous()


def _binary(x: torch.Tensor, groups: int) -> torch.Tensor:
    flat = x.reshape(groups, -1)
    mean = flat.norm(p=1, dim=1, keepdim=True).div(flat.shape[1])
    return flat.sign().mul(mean).reshape(x.shape).contiguous()


class _StraightThrough(torch.autograd.Function):
    """Forward: `quantize_reference`; backward: the gradient as it came (d q / d x := 1)."""

    @staticmethod
    def forward(ctx, x, bits, symmetric, groups, value_range):  # type: ignore[override]
        return quantize_reference(x, bits, symmetric, groups, value_range)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.clone(), None, None, None, None


def fake_quantize(
    x: torch.Tensor,
    bits: int,
    symmetric: bool = True,
    groups: int = 1,
    value_range: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`quantize_reference(x, ...)` in the forward, the identity in the backward (STE)."""
    return _StraightThrough.apply(x, bits, symmetric, groups, value_range)


class _TopK(torch.autograd.Function):
    """Forward: 1.0 on the `ceil(ratio · n)` largest scores, 0.0 elsewhere; backward: the
    gradient straight through to the scores (so learned scores move toward useful weights)."""

    @staticmethod
    def forward(ctx, scores, dense_ratio):  # type: ignore[override]
        mask = scores.clone()
        _, order = scores.flatten().sort(descending=True)
        kept = math.ceil(dense_ratio * scores.numel())
        flat = mask.view(-1)
        flat[order[kept:]] = 0.0
        flat[order[:kept]] = 1.0
        return mask

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad.clone(), None


def top_k_mask(scores: torch.Tensor, dense_ratio: float) -> torch.Tensor:
    """A 0/1 mask of `scores`' shape keeping the `ceil(dense_ratio · numel)` largest entries
    (ties in `torch.sort`'s order); gradients reach `scores` straight through."""
    return _TopK.apply(scores, dense_ratio)
