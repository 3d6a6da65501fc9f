"""Weight-only int8 quantization: per-output-channel absmax scales, and the int8 linear module.

For a weight W (N, K), row n gets `s_n = max_k |W[n, k]| / 127` and `q = round(W / s_n)` in
[-127, 127]. Bytes kept: N·K (int8) + 4·N (scales) instead of 4·N·K, so ≈ 4× less as K grows.

Error math: rounding to nearest leaves `|W[n,k] − q[n,k]·s_n| ≤ s_n / 2`, so an output of the
quantized linear differs from fp32 by at most `(s_n / 2) · Σ_k |x_k|` (the test checks this bound).

A vocabulary table (V, C) (token embedding, output head, or both when tied) is quantized the
same way, one scale per token row (`Int8Embedding`): a lookup dequantizes only the rows it
gathers, and the head is an `int8_linear` over the same bytes, so a tied table is held once as
V·C + 4·V bytes instead of 4·V·C.
"""

from __future__ import annotations

import torch
from torch import nn

from minispeed.inference import kernels

__all__ = ["Int8Embedding", "Int8Linear", "held_bytes", "quantize_per_channel", "weight_bytes"]


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


class Int8Embedding(nn.Module):
    """A (V, C) vocabulary table held as int8 rows with one fp32 scale per row: the token embedding
    (`forward(idx)`: the gathered rows dequantized, `q[idx] · s[idx]`) and, tied or on its own,
    the output head (`logits(x)`: `kernels.int8_linear(x, q, s)`, each byte read once per call).

    Bytes kept: V·C + 4·V (GPT-2's tied 50257 × 768 table: 38.8 MB against 154.4 MB). A lookup
    of R tokens reads R·(C + 4) bytes and writes 4·R·C; the head reads all V·C + 4·V. The source
    tensor is not referenced afterwards. Rounding leaves each entry within s_v / 2 of fp32, so a
    logit is within `(s_v / 2) · Σ_k |x_k|` of the fp32 head's (the bound of `Int8Linear`).
    """

    def __init__(self, table: nn.Embedding | torch.Tensor) -> None:
        super().__init__()
        if isinstance(table, nn.Embedding):
            if table.max_norm is not None:  # nn.Embedding rescales looked-up rows in place
                raise ValueError("an embedding with max_norm cannot be held as int8: drop max_norm")
            table = table.weight
        q, s = quantize_per_channel(table)
        self.register_buffer("weight_q", q)  # (V, C) int8
        self.register_buffer("scales", s)  # (V,) fp32
        self.num_embeddings, self.embedding_dim = q.shape

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.weight_q[idx].float() * self.scales[idx].unsqueeze(-1)  # (..., C) fp32

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """`x (..., C) @ (q · s)ᵀ`: `(..., V)` fp32, the table used as the output head."""
        return kernels.int8_linear(x, self.weight_q, self.scales)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows"


def held_bytes(module: nn.Module) -> int:
    """Bytes of the tensors `module` holds (parameters and buffers), each storage counted once:
    what stays allocated for it once nothing else references the source model."""
    storages: dict[int, int] = {}
    for t in (*module.parameters(), *module.buffers()):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


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
