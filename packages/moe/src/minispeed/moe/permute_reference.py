"""The permutation kernels in plain PyTorch: the specification of ``csrc/permute`` and its fallback.

Two row operations carry all of MoE's data movement on one rank:

- `gather_rows(src, index, scale)`: `out[i] = scale[i] * src[index[i]]`, a zero row where
  `index[i] == -1`. Dispatch ("permute") is this with `index` = the token each expert slot
  reads; the backward of combine is this too.
- `combine_rows(src, index, weight)`: `out[t] = Σ_j weight[t, j] * src[index[t, j]]` over the
  k columns of `index` (shape (T, k)), skipping `-1`. Combine ("unpermute") is this with
  `index` = the slot holding each of the token's k expert outputs; the backward of dispatch is
  this too (with weight 1).

Both read each output row from known places (a gather), so the compiled versions write every
output row from one thread without atomics. Not differentiable themselves: the autograd
functions in `minispeed.moe.permute` pair them as each other's backward.
"""

from __future__ import annotations

import torch

__all__ = ["check_index", "combine_rows", "gather_rows"]


def check_index(name: str, index: torch.Tensor, rows: int) -> None:
    """Raise `IndexError` naming the first entry outside [-1, rows): -1 means 'no row'."""
    if index.dtype != torch.int64:
        raise TypeError(f"{name}: index must be int64, got {index.dtype}; call .long() first")
    bad = (index < -1) | (index >= rows)
    if bool(bad.any()):
        at = int(bad.reshape(-1).nonzero()[0])
        value = int(index.reshape(-1)[at])
        raise IndexError(
            f"{name}: index {value} at position {at} is outside [-1, {rows}); -1 marks an empty "
            "slot, every other entry must name a source row"
        )


def gather_rows(
    src: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """`out[i] = scale[i] * src[index[i]]` (zero row for index -1). `src` (R, d), `index` (N,).

    Reads and writes N·d elements. `scale` (N,) defaults to ones.
    """
    check_index("gather_rows", index, src.shape[0])
    valid = (index >= 0)[:, None]
    out = src[index.clamp(min=0)]  # (N, d)
    if scale is not None:
        out = out * scale.to(src.dtype)[:, None]
    return torch.where(valid, out, torch.zeros((), dtype=src.dtype, device=src.device))


def combine_rows(
    src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """`out[t] = Σ_j weight[t, j] * src[index[t, j]]` (index -1 skipped). `index` (T, k).

    Reads T·k·d and writes T·d elements. `weight` (T, k) defaults to ones. The sum runs in j
    order, as the compiled kernels do.
    """
    check_index("combine_rows", index, src.shape[0])
    out = src.new_zeros(index.shape[0], src.shape[1])
    for j in range(index.shape[1]):
        rows = src[index[:, j].clamp(min=0)]  # (T, d)
        if weight is not None:
            rows = rows * weight[:, j, None].to(src.dtype)
        out += torch.where((index[:, j] >= 0)[:, None], rows, torch.zeros((), dtype=src.dtype))
    return out
