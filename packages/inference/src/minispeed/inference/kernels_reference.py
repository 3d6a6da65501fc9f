"""The pure-PyTorch reference of `minispeed.inference.kernels`: the specification and the fallback.

Every function has the signature of its compiled twin and is written in plain tensor ops, so a
reader can check the math in a few lines. Tests compare the C++ op against these on random odd
shapes; when the op cannot be built (no compiler, `MINISPEED_DISABLE_OPS=inference_kernels`) or
the tensor is not on the CPU, the wrappers call these instead.

Shapes use B = sequences, T = tokens, H = heads, D = head dim, C = model width, L = cached length.
Not differentiable by design: inference runs under `torch.no_grad()`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "argmax",
    "bias_gelu",
    "decode_attention",
    "int8_linear",
    "layer_norm",
    "linear",
    "linear_many",
    "masked_softmax",
    "rms_norm",
    "rotary_embedding",
    "rotary_tables",
    "swiglu",
]


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(LayerNorm(h), h)` with `h = x + residual` (`h = x` without one), over the last dim.

    Returning `h` lets a pre-norm block keep its residual stream from the same pass:
    `normed, stream = layer_norm(attn_out, ln2.weight, ln2.bias, residual=stream)`.
    """
    h = x if residual is None else x + residual
    return F.layer_norm(h, h.shape[-1:], weight, bias, eps), h


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(h / sqrt(mean(h²) + eps) * weight, h)` with `h = x + residual`, over the last dim."""
    h = x if residual is None else x + residual
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight, h


def bias_gelu(
    x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """`gelu(x + bias)` as `torch.nn.functional.gelu` computes it: the exact (erf) GeLU, or the
    tanh approximation with `approximate="tanh"`."""
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def masked_softmax(
    scores: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0
) -> torch.Tensor:
    """Softmax of `scale * scores` over the last dim where `mask` is True (broadcastable bool).

    Masked entries get probability 0; a row whose entries are all masked is all zeros (not NaN).
    """
    s = scores * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.nan_to_num(p, nan=0.0)  # all-masked rows: exp(-inf - -inf) is NaN -> 0


def rotary_tables(
    max_positions: int, head_dim: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos, sin)`, each fp32 `(max_positions, head_dim // 2)`: angle `pos · base^(-2i/head_dim)`."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def rotary_embedding(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate-half rotary embedding of `x` `(T, H, D)` at integer `positions` `(T,)`.

    With `x1, x2 = x[..., :D/2], x[..., D/2:]` and `c, s = cos[pos], sin[pos]`:
    `out = cat(x1·c − x2·s, x2·c + x1·s)` (the GPT-NeoX / LLaMA layout).
    """
    half = x.shape[-1] // 2
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]  # (T, 1, D/2)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One query token per sequence over its paged cache: `(B, H, D)` out for `q` `(B, H, D)`.

    `k_cache`, `v_cache` are `(num_blocks, block_size, KV, D)`, `H` a multiple of `KV` (query
    head h reads cached head `h // (H // KV)`: grouped-query attention); sequence b's position t
    is in block `block_tables[b, t // block_size]` at slot `t % block_size`; `seq_lens[b]`
    positions are valid. The naive version: gather each sequence's keys and values into a dense
    `(L, KV, D)` tensor, repeat each head `H // KV` times, then ordinary attention. `scale`
    defaults to `1/sqrt(D)`.
    """
    B, H, D = q.shape
    group = H // k_cache.shape[2]
    block_size = k_cache.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.zeros_like(q)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        t = torch.arange(n)
        blocks = block_tables[b, t // block_size].long()
        k = k_cache[blocks, t % block_size].repeat_interleave(group, dim=1)  # (L, H, D)
        v = v_cache[blocks, t % block_size].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], k) * scale
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
    return out


def int8_linear(
    x: torch.Tensor,
    weight_q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x @ (weight_q · scales[:, None])ᵀ + bias`: int8 `(N, K)` weight, fp32 per-row `scales` `(N,)`.

    The naive version dequantizes the whole weight to fp32 first (4 N K bytes of temporaries).
    """
    return F.linear(x, weight_q.float() * scales[:, None], bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weightᵀ + bias` for `x` `(..., K)` and `weight` `(N, K)`: `torch.nn.functional.linear`.

    The compiled twin reads the weight once for up to 8 rows of `x` (a decode step); the
    reference is torch's own GEMM.
    """
    return F.linear(x, weight, bias)


def linear_many(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None
) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, w_i, b_i)` for each weight (LLaMA's q, k, v over one input), one GEMM each."""
    biases = [None] * len(weights) if biases is None else biases
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))


def swiglu(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`silu(x @ gateᵀ + gate_bias) · (x @ upᵀ + up_bias)`: LLaMA's MLP before its down
    projection (transformers' `LlamaMLP`), two GEMMs and two elementwise passes."""
    return F.silu(F.linear(x, gate, gate_bias)) * F.linear(x, up, up_bias)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest entry of each row of `x` `(..., V)`, int64 `(...)`: `x.argmax(-1)`
    (the first one on ties, the first NaN if any: torch's rule). Greedy decoding's pick."""
    return x.argmax(dim=-1)
