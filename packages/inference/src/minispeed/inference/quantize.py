"""Weight-only int8 quantization: per-output-channel absmax scales, and the int8 linear module.

For a weight W (N, K), row n gets `s_n = max_k |W[n, k]| / 127` and `q = round(W / s_n)` in
[-127, 127]. Bytes kept: N·K (int8) + 4·N (scales) instead of 4·N·K, so ≈ 4× less as K grows.

Error math: rounding to nearest leaves `|W[n,k] − q[n,k]·s_n| ≤ s_n / 2`, so an output of the
quantized linear differs from fp32 by at most `(s_n / 2) · Σ_k |x_k|` (the test checks this bound).
"""

from __future__ import annotations

import torch
from torch import nn

from minispeed.inference import kernels

__all__ = ["Int8Linear", "quantize_per_channel", "weight_bytes"]


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q int8 (N, K), scales fp32 (N,))` with `weight ≈ q · scales[:, None]` (absmax per row).

    An all-zero row gets scale 1 (any scale represents it exactly), never a division by zero.
    `q` is contiguous whatever `weight`'s strides (a Conv1D weight's transposed view included),
    so the kernel reads it in place.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"weight must be a 2-D float tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    # contiguous: a transposed view (Hugging Face's Conv1D weight) would otherwise give q the
    # view's strides, and the kernel would copy the whole weight on every call
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scales


class Int8Linear(nn.Module):
    """`y = x @ (q · s)ᵀ + b` with the weight held as int8 and dequantized inside the kernel."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        q, s = quantize_per_channel(linear.weight)
        self.register_buffer("weight_q", q)  # (N, K) int8
        self.register_buffer("scales", s)  # (N,) fp32
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.int8_linear(x, self.weight_q, self.scales, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight"


def weight_bytes(module: nn.Module) -> int:
    """Bytes held by the weights of `module`'s linears: fp32 `nn.Linear` or `Int8Linear` (incl. scales)."""
    total = 0
    for m in module.modules():
        if isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, Int8Linear):
            total += m.weight_q.numel() * m.weight_q.element_size()
            total += m.scales.numel() * m.scales.element_size()
    return total
