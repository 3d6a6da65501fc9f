"""The pure-PyTorch reference of block-sparse attention: dense attention under the expanded mask.

This is the specification the C++ op is tested against (values and gradients, through
autograd) and the fallback where the op cannot run (no compiler, a CUDA tensor). It builds the
full `(H, T, T)` mask and `(B, H, T, T)` scores, so it costs what dense attention costs:
`4 B H T² D` FLOPs and `4 B H T²` bytes of scores, whatever the layout's density.
"""

from __future__ import annotations

import torch

__all__ = ["expand_layout", "sparse_attention_reference"]


def expand_layout(layout: torch.Tensor, block: int, *, causal: bool = False) -> torch.Tensor:
    """The token mask `(H, T, T)` (True = attend) of a block layout `(H, NB, NB)`.

    With `causal`, key `j` is also dropped for query `i < j` (inside the diagonal block too).
    """
    mask = layout.repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)
    if causal:
        mask = torch.tril(mask)
    return mask


def sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: torch.Tensor,
    block: int,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """`softmax(q kᵀ · scale, masked by the layout) v` for `q, k, v` `(B, H, T, D)`.

    `scale` defaults to `1 / sqrt(D)`. Differentiable (plain autograd).
    """
    D = q.shape[-1]
    scale = D**-0.5 if scale is None else scale
    mask = expand_layout(layout.to(q.device), block, causal=causal)  # (H, T, T)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, T)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
