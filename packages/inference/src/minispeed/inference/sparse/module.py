"""`SparseSelfAttention`: the block-sparse op as an `nn.Module`, for training and serving.

Like DeepSpeed's module of the same name, it takes the projected `query, key, value`
`(B, H, T, D)` and returns the attention output `(B, H, T, D)`; the projections stay in the
model. The layout comes from a `SparsityConfig` and is built once per sequence length (a
dict from `T` to its `BlockSparseLayout`). `attention="unidirectional"` in the config makes
the attention causal token by token. DeepSpeed's `key_padding_mask`, `attn_mask` and relative
position embeddings are not supported: pad to a multiple of the block and use a causal config.
"""

from __future__ import annotations

import torch
from torch import nn

from minispeed.inference.sparse.attention import BlockSparseLayout, block_sparse_attention
from minispeed.inference.sparse.layouts import SparsityConfig

__all__ = ["SparseSelfAttention"]


class SparseSelfAttention(nn.Module):
    """Block-sparse scaled dot-product attention over the layout of `sparsity_config`.

    Parameters: none (it only attends). Memory kept per layer for the backward:
    `(4 D + 1) B H T` floats (q, k, v, out, log-sum-exp), no `T × T` buffer.
    """

    def __init__(self, sparsity_config: SparsityConfig, max_seq_length: int = 2048) -> None:
        super().__init__()
        self.sparsity_config = sparsity_config
        self.max_seq_length = max_seq_length
        self._layouts: dict[int, BlockSparseLayout] = {}

    def layout(self, seq_len: int) -> BlockSparseLayout:
        """The checked CSR layout for `seq_len` tokens (built on first use, then cached)."""
        if seq_len > self.max_seq_length:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_length {self.max_seq_length}: "
                "raise max_seq_length or crop the input"
            )
        if seq_len not in self._layouts:
            cfg = self.sparsity_config
            self._layouts[seq_len] = BlockSparseLayout.from_layout(
                cfg.make_layout(seq_len), cfg.block, causal=cfg.causal
            )
        return self._layouts[seq_len]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attention output `(B, H, T, D)` for `query, key, value` `(B, H, T, D)`."""
        if query.dim() != 4:
            raise ValueError(
                f"query must be (batch, heads, seq, head_dim), got {tuple(query.shape)}"
            )
        if query.shape[1] != self.sparsity_config.num_heads:
            raise ValueError(
                f"query has {query.shape[1]} heads but the sparsity config "
                f"{self.sparsity_config.num_heads}: build it with num_heads={query.shape[1]}"
            )
        self.sparsity_config.num_blocks(query.shape[2])  # a clear error for a ragged length
        return block_sparse_attention(query, key, value, self.layout(query.shape[2]))

    def extra_repr(self) -> str:
        return f"{type(self.sparsity_config).__name__}, max_seq_length={self.max_seq_length}"
