"""Block-sparse attention (DeepSpeed's `sparse_attention`): layouts, the op, the module.

Reading order: `.layouts` (which tiles each head keeps; `SparsityConfig.from_section`),
`.reference` (dense attention under the expanded mask: the specification), `.attention` (the
CSR layout, the C++ op's autograd function and the dispatch), `.module` (`SparseSelfAttention`).

```python
from minispeed.inference.sparse import FixedSparsityConfig, SparseSelfAttention

attn = SparseSelfAttention(FixedSparsityConfig(num_heads=8, block=16, attention="unidirectional"))
y = attn(q, k, v)  # (B, 8, T, D), T a multiple of 16; trains (forward and backward)
```
"""

from minispeed.inference.sparse.attention import (
    BlockSparseAttentionFunction,
    BlockSparseLayout,
    block_sparse_attention,
)
from minispeed.inference.sparse.layouts import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
    check_layout,
    draw_layout,
    layout_density,
)
from minispeed.inference.sparse.module import SparseSelfAttention
from minispeed.inference.sparse.reference import expand_layout, sparse_attention_reference

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "BlockSparseAttentionFunction",
    "BlockSparseLayout",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
    "block_sparse_attention",
    "check_layout",
    "draw_layout",
    "expand_layout",
    "layout_density",
    "sparse_attention_reference",
]
