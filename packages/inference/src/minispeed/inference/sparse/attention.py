"""Block-sparse attention: the layout in CSR form, the autograd op, and the dispatch.

`block_sparse_attention(q, k, v, layout, block)` computes, for `q, k, v` `(B, H, T, D)`,
`softmax(q kᵀ / sqrt(D) + mask) v` where the mask keeps the `block × block` tiles the layout
keeps (and, with `causal`, keys at or before the query). It equals
`reference.sparse_attention_reference` (dense attention under the expanded mask) to fp32
rounding, values and gradients, and runs:

- fp32 CPU tensors: the C++ op (`csrc/kernels/sparse_attention.cpp`, part of the
  `inference_kernels` extension; SIMD level from `MINISPEED_SIMD`, OpenMP), forward and backward;
- CUDA tensors, or no op (`MINISPEED_DISABLE_OPS=inference_kernels`, no compiler): the reference.
  (`csrc/kernels/sparse_attention_cuda.cu` holds CUDA kernels, compiled by core's nvcc test;
  their binding is not wired up in this cut.)

Costs per call, with density ρ = kept tiles / (H · NB²) (causal: tiles on or below the diagonal):
forward `4 ρ B H T² D` FLOPs, backward about `10 ρ B H T² D` (the scores are recomputed, see
Note [no scores kept between forward and backward] in the C++ source); memory kept for the
backward: q, k, v, out and the log-sum-exp, `(4 D + 1) B H T` floats, against dense eager
attention's `B H T²` probabilities. Dense attention does `4 B H T² D` FLOPs whatever the mask.
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType

import torch

from minispeed.core import ranges
from minispeed.inference import kernels
from minispeed.inference.sparse.layouts import check_layout, layout_density
from minispeed.inference.sparse.reference import sparse_attention_reference

__all__ = ["BlockSparseLayout", "block_sparse_attention"]


@dataclasses.dataclass(frozen=True)
class BlockSparseLayout:
    """A checked layout with its per-head CSR: what the C++ op reads.

    `row_ptr` `(H, NB + 1)` int32 holds offsets into the flat `cols` (int32 key-block ids, sorted
    within each row); with `causal`, tiles above the diagonal are dropped (they hold only future
    keys). Build once per sequence length (`from_layout` costs `O(H · NB²)`); reuse per call.
    """

    layout: torch.Tensor  # (H, NB, NB) bool
    block: int
    causal: bool
    row_ptr: torch.Tensor  # (H, NB + 1) int32
    cols: torch.Tensor  # (nnz,) int32

    @classmethod
    def from_layout(
        cls, layout: torch.Tensor, block: int, *, causal: bool = False
    ) -> BlockSparseLayout:
        """Check `layout` (no empty row) and build its CSR."""
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        layout = layout.detach().cpu()
        check_layout(layout, causal=causal)
        kept = torch.tril(layout) if causal else layout
        H, NB, _ = kept.shape
        counts = kept.sum(dim=-1).flatten()  # (H * NB,)
        offsets = torch.zeros(H * NB + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(counts, 0)
        index = torch.arange(H)[:, None] * NB + torch.arange(NB + 1)[None, :]  # (H, NB + 1)
        row_ptr = offsets[index].to(torch.int32).contiguous()
        cols = kept.nonzero()[:, 2].to(torch.int32).contiguous()  # row-major: sorted per row
        return cls(layout, block, causal, row_ptr, cols)

    @property
    def num_heads(self) -> int:
        """H."""
        return self.layout.shape[0]

    @property
    def seq_len(self) -> int:
        """T = NB · block."""
        return self.layout.shape[1] * self.block

    @property
    def density(self) -> float:
        """Fraction of the `H · NB²` tiles computed (see `layout_density`)."""
        return layout_density(self.layout, causal=self.causal)


def _load_sparse_op() -> ModuleType | None:
    op = kernels.load_op()
    return op if op is not None and hasattr(op, "sparse_attention_forward") else None


class BlockSparseAttentionFunction(torch.autograd.Function):
    """The C++ forward and backward as one autograd node (inputs fp32, contiguous, on the CPU)."""

    @staticmethod
    def forward(ctx, q, k, v, csr: BlockSparseLayout, op: ModuleType, scale: float):
        B, H, T, D = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(B, H, T, dtype=torch.float32)  # log-sum-exp per query, for backward
        with ranges.range("inference.sparse_attention.forward"):
            op.sparse_attention_forward(
                q.data_ptr(), k.data_ptr(), v.data_ptr(), csr.row_ptr.data_ptr(),
                csr.cols.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, T, D, csr.block,
                csr.causal, scale,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.csr, ctx.op, ctx.scale = csr, op, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        csr = ctx.csr
        dout = dout.contiguous()
        if dout.dtype != torch.float32:
            dout = dout.float()
        B, H, T, D = q.shape
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # written whole
        with ranges.range("inference.sparse_attention.backward"):
            ctx.op.sparse_attention_backward(
                q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(),
                lse.data_ptr(), csr.row_ptr.data_ptr(), csr.cols.data_ptr(), dq.data_ptr(),
                dk.data_ptr(), dv.data_ptr(), B, H, T, D, csr.block, csr.causal, ctx.scale,
            )  # fmt: skip
        return dq, dk, dv, None, None, None


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: torch.Tensor | BlockSparseLayout,
    block: int | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of `q, k, v` `(B, H, T, D)` over the tiles `layout` keeps; differentiable.

    `layout` is a bool `(H, T/block, T/block)` (then `block` is required) or a prebuilt
    `BlockSparseLayout` (its own block and causal flag win). `scale` defaults to `1/sqrt(D)`.
    """
    if isinstance(layout, BlockSparseLayout):
        csr = layout
    else:
        if block is None:
            raise ValueError("pass block= with a layout tensor (tokens per layout block)")
        csr = BlockSparseLayout.from_layout(layout, block, causal=causal)
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k and v must share one shape (batch, heads, seq, head_dim), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    _, heads, seq, dim = q.shape
    if seq % csr.block:
        pad = -seq % csr.block
        raise ValueError(
            f"sequence length {seq} is not a multiple of the sparsity block {csr.block}: pad the "
            f"sequence by {pad} tokens (to {seq + pad}) and mask the padding"
        )
    if (heads, seq) != (csr.num_heads, csr.seq_len):
        raise ValueError(
            f"the layout is for {csr.num_heads} heads and {csr.seq_len} tokens, the inputs have "
            f"{heads} heads and {seq} tokens: build it with make_layout({seq}) and num_heads={heads}"
        )
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    if not scale > 0:  # the op takes each row's max before scaling: see sparse_attention.cpp
        raise ValueError(f"scale must be > 0 (it multiplies q·kᵀ before the softmax), got {scale}")
    on_cpu = all(t.device.type == "cpu" for t in (q, k, v))
    if on_cpu and any(t.dtype != torch.float32 for t in (q, k, v)):
        raise TypeError(
            f"the CPU block-sparse attention op takes float32, got {q.dtype}/{k.dtype}/{v.dtype}: "
            "call .float() (bf16/fp16 kernels are not implemented)"
        )
    op = _load_sparse_op() if on_cpu else None
    if op is None:
        return sparse_attention_reference(
            q, k, v, csr.layout, csr.block, causal=csr.causal, scale=scale
        )
    return BlockSparseAttentionFunction.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), csr, op, scale
    )
