"""A Hugging Face LLaMA decoder layer rebuilt on the fused kernels (used by `LlamaPolicy`).

Per layer, with positions p and the model's rotary tables (`rotary_tables_of`):

```text
a       = RMSNorm1(x)                                   kernels.rms_norm
q, k, v = q_proj(a), k_proj(a), v_proj(a)               kernels.linear_many: one call, three outputs
q, k    = RoPE(q, p), RoPE(k, p)                        kernels.rotary_embedding
y       = attention(q, k, v)                            SDPA, or paged decode attention
n2, h   = RMSNorm2(o_proj(y) + x), h = o_proj(y) + x    kernels.rms_norm(residual=x)
out     = h + down(silu(gate(n2)) · up(n2))             kernels.swiglu: gate and up in one pass
```

q, k, v (and gate, up) keep their own weight tensors, shared with the Hugging Face layer: one
C++ call reads them in turn, so nothing is concatenated or copied (see Note [several weights,
one pass over x] in csrc/kernels/linear.cpp). With int8 weights they are separate calls.

Grouped-query attention: K and V keep their KV heads. The paged cache stores each K/V head once
(`InferenceGPT.n_kv_head`: `8 · L · KV · D` bytes per cached token, H / KV times less than
repeating them per query head), the decode kernel has query head h read cached head
`h // (H / KV)`, and the full and prefill forwards call SDPA with `enable_gqa`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minispeed.inference import kernels
from minispeed.inference.fused_gpt import Attend, StreamingLinear, _linear, _row_parallel
from minispeed.inference.tensor_parallel import TPContext, column_shard

__all__ = ["STATIC_ROPE_TYPES", "FusedLlamaBlock", "rotary_tables_of"]

# RoPE variants whose angles depend on the position only (not on the sequence length), so one
# table serves every forward: transformers' "dynamic" NTK and "longrope" rescale with the length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rotary_tables_of(
    rotary: nn.Module, max_positions: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(cos, sin)` fp32 `(max_positions, head_dim // 2)` of a transformers rotary module.

    Its `inv_freq` already carries the variant's frequency scaling (linear, llama3, yarn) and
    `attention_scaling` its magnitude (yarn's mscale; 1 otherwise), so
    `cos[p, i] = attention_scaling · cos(p · inv_freq[i])` is what the layer applies. Angles in
    float64, as `kernels.rotary_tables`. Only for `STATIC_ROPE_TYPES`.
    """
    inv_freq = rotary.inv_freq.detach().to(torch.float64).cpu()
    if inv_freq.numel() * 2 != head_dim:
        raise ValueError(f"rotary inv_freq has {inv_freq.numel()} entries, head_dim is {head_dim}")
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq[None, :]
    device = rotary.inv_freq.device
    return (angles.cos() * scale).float().to(device), (angles.sin() * scale).float().to(device)


class FusedLlamaBlock(nn.Module):
    """`LlamaDecoderLayer` on the fused kernels (weights shared, or int8 copies).

    With `tp`: H/n query heads and KV/n key/value heads (q, k, v column-parallel), the matching
    columns of o (row-parallel), F/n rows of gate and up, columns of down (row-parallel).
    """

    is_fused = True

    def __init__(
        self, layer: nn.Module, n_head: int, n_kv_head: int,
        rotary: tuple[torch.Tensor, torch.Tensor], int8: bool = False, tp: TPContext | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        n = 1 if tp is None else tp.size
        self.n_head, self.n_kv_head, self.head_dim = n_head // n, n_kv_head // n, attn.head_dim
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        columns = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        if tp is not None:
            columns = [column_shard(m, tp) for m in columns]
        self.q, self.k, self.v, self.gate, self.up = (_linear(m, int8) for m in columns)
        # fp32 weights: q/k/v in one kernels.linear_many call, gate/up in one kernels.swiglu.
        self.streaming = not int8 and all(isinstance(m, StreamingLinear) for m in
                                          (self.q, self.k, self.v, self.gate, self.up))  # fmt: skip
        self.o = _row_parallel(attn.o_proj, int8, tp)
        self.down = _row_parallel(mlp.down_proj, int8, tp)
        cos, sin = rotary  # (max_positions, head_dim / 2) each
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _rope(self, t: torch.Tensor, heads: int, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = t.shape
        flat = t.reshape(B * T, heads, self.head_dim)
        # InferenceGPT checked the positions against its max_positions (the tables' length)
        # once for this forward: see Note [decode step plan] in fused_gpt.py.
        rotated = kernels.rotary_embedding(
            flat, positions.reshape(-1), self.cos, self.sin, validate=False
        )
        return rotated.view(B, T, -1)

    def _qkv(self, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.streaming:
            ms = (self.q, self.k, self.v)
            return kernels.linear_many(a, [m.weight for m in ms], [m.bias for m in ms])
        return self.q(a), self.k(a), self.v(a)

    def _mlp_in(self, n2: torch.Tensor) -> torch.Tensor:  # silu(gate(n2)) · up(n2)
        if self.streaming:
            return kernels.swiglu(
                n2, self.gate.weight, self.up.weight, self.gate.bias, self.up.bias
            )
        return F.silu(self.gate(n2)) * self.up(n2)

    def forward(
        self, x: torch.Tensor, layer: int, attend: Attend, positions: torch.Tensor
    ) -> torch.Tensor:
        B, T, _ = x.shape
        pos = positions.expand(B, T)  # (T,) in full and prefill, (B, 1) in decode -> (B, T)
        a, _ = kernels.rms_norm(x, self.ln1.weight, self.ln1.variance_epsilon)
        q, k, v = self._qkv(a)
        y = attend(layer, self._rope(q, self.n_head, pos), self._rope(k, self.n_kv_head, pos), v)
        n2, h = kernels.rms_norm(self.o(y), self.ln2.weight, self.ln2.variance_epsilon, residual=x)
        return h + self.down(self._mlp_in(n2))
