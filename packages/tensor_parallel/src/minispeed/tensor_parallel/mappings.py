"""The communication of tensor parallelism as autograd functions: each forward collective paired
with its conjugate in backward.

Megatron-LM's four regions, and sequence parallelism's three. `n` is the group size, `S` the
bytes of the tensor named; "last dim" is the hidden (or head, or vocabulary) dimension the
weights are split along, "sequence dim" is dim -2 of a `(..., T, C)` activation.

| function | forward | backward |
|---|---|---|
| `copy_to_parallel` | identity | all-reduce of the gradient (S) |
| `reduce_from_parallel` | all-reduce (S) | identity |
| `gather_from_parallel` | all-gather along the last dim (S = gathered) | keep this rank's slice |
| `scatter_to_parallel` | keep this rank's slice of the last dim | all-gather (S = gathered) |
| `gather_from_sequence` | all-gather along the sequence dim (S = gathered) | reduce-scatter (S) |
| `reduce_scatter_to_sequence` | reduce-scatter along the sequence dim (S = unreduced input) | all-gather (S) |
| `scatter_to_sequence` | keep this rank's sequence slice | all-gather (S = gathered) |

`copy` and `reduce` are conjugate: a column-parallel layer's input is copied (every rank reads the
whole activation, so the gradients of the copies are summed in backward); a row-parallel layer's
partial outputs are summed in forward (each rank's input gradient is then its own). Sequence
parallelism replaces the all-reduce (2(n-1)/n · S on the wire) by a reduce-scatter plus an
all-gather ((n-1)/n · S each): the same bytes, but the activations between them are 1/n.

Every collective goes through `minispeed.comm`, so the comms logger records it. On a group of
one rank these are identities and issue nothing.
"""

from __future__ import annotations

from typing import Any

import torch

import minispeed.comm as comm
from minispeed.tensor_parallel.group import TensorGroup

__all__ = [
    "SEQ_DIM",
    "all_gather_along",
    "copy_to_parallel",
    "gather_from_parallel",
    "gather_from_sequence",
    "reduce_from_parallel",
    "reduce_scatter_along",
    "reduce_scatter_to_sequence",
    "scatter_to_parallel",
    "scatter_to_sequence",
    "split_along",
]

SEQ_DIM = -2
"""The sequence dim of activations: `(B, T, C)`, and `(T, C)` position embeddings alike."""


# -- the raw collectives along one dimension (no autograd) --------------------------------------
def all_gather_along(x: torch.Tensor, dim: int, tg: TensorGroup) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order; one all-gather of n · |x| bytes."""
    if tg.size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((tg.size, *x.shape), dtype=x.dtype, device=x.device)  # rank-major
    comm.all_gather_into_tensor(out, x, group=tg.group)
    return torch.cat(out.unbind(0), dim=dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, tg: TensorGroup) -> torch.Tensor:
    """Chunk `rank` along `dim` of the sum of every rank's `x`; one reduce-scatter of |x| bytes."""
    if tg.size == 1:
        return x
    chunks = torch.stack(_chunks(x, dim, tg, "reduce-scatter"))  # (n, ...): chunk r is rank r's
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, chunks, group=tg.group)
    return out


def split_along(x: torch.Tensor, dim: int, tg: TensorGroup) -> torch.Tensor:
    """This rank's chunk of `x` along `dim` (a copy); no communication."""
    if tg.size == 1:
        return x
    return _chunks(x, dim, tg, "split")[tg.rank].contiguous()


def _chunks(x: torch.Tensor, dim: int, tg: TensorGroup, what: str) -> tuple[torch.Tensor, ...]:
    """`x` in `tg.size` equal views along `dim` (chunk r is rank r's); raises if it does not divide."""
    if x.shape[dim] % tg.size:
        raise ValueError(
            f"{what} along dim {dim}: size {x.shape[dim]} is not divisible by the "
            f"tensor-parallel size {tg.size}; pad it (e.g. the sequence) to a multiple of {tg.size}"
        )
    return x.chunk(tg.size, dim)


def _all_reduce(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    if tg.size > 1:
        comm.all_reduce(x, group=tg.group)
    return x


# -- the autograd pairs --------------------------------------------------------------------------
class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
        ctx.tg = tg
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.contiguous().clone(), ctx.tg), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
        # In place on a fresh matmul output (no autograd node saved it): no copy of S bytes.
        ctx.mark_dirty(x)
        return _all_reduce(x, tg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Along(torch.autograd.Function):
    """One autograd pair along a dim: `forward(x, dim, tg)` now, its conjugate on the gradient in
    backward (the table in the module docstring; e.g. all-gather / split)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, tg: TensorGroup, dim: int, forward: Any, conjugate: Any
    ) -> torch.Tensor:
        ctx.tg, ctx.dim, ctx.conjugate = tg, dim, conjugate
        return forward(x, dim, tg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.conjugate(grad, ctx.dim, ctx.tg), None, None, None, None


def copy_to_parallel(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient (2(n-1)/n · S on the wire)."""
    return _CopyToParallel.apply(x, tg)


def reduce_from_parallel(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    """All-reduce (sum) forward, in place on `x` (2(n-1)/n · S on the wire); identity backward.

    `x` is normally a fresh matmul output, summed where it lies; a leaf that requires grad (which
    autograd forbids writing to) is copied first."""
    if x.is_leaf and x.requires_grad:
        x = x.clone()
    return _ReduceFromParallel.apply(x, tg)


def gather_from_parallel(x: torch.Tensor, tg: TensorGroup, dim: int = -1) -> torch.Tensor:
    """All-gather along `dim` forward ((n-1)/n · S, S the gathered bytes); backward keeps this
    rank's slice of the gradient."""
    return _Along.apply(x, tg, dim, all_gather_along, split_along)


def scatter_to_parallel(x: torch.Tensor, tg: TensorGroup, dim: int = -1) -> torch.Tensor:
    """Keep this rank's slice along `dim` forward; backward all-gathers the gradient."""
    return _Along.apply(x, tg, dim, split_along, all_gather_along)


def gather_from_sequence(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    """All-gather the sequence shards forward; backward reduce-scatters the gradient (each rank's
    consumer read the whole sequence, so the gradient of each shard is a sum over ranks)."""
    return _Along.apply(x, tg, SEQ_DIM, all_gather_along, reduce_scatter_along)


def reduce_scatter_to_sequence(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    """Sum the partial outputs and keep this rank's sequence shard (reduce-scatter) forward;
    backward all-gathers the gradient."""
    return _Along.apply(x, tg, SEQ_DIM, reduce_scatter_along, all_gather_along)


def scatter_to_sequence(x: torch.Tensor, tg: TensorGroup) -> torch.Tensor:
    """Keep this rank's sequence shard forward; backward all-gathers the gradient (replicated
    inputs, such as position embeddings, then get the whole gradient on every rank)."""
    return _Along.apply(x, tg, SEQ_DIM, split_along, all_gather_along)
