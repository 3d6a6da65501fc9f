"""Bytes per call of each tensor-parallel layer, written once: the docstrings, the tests and the
docs page all use these functions.

A layer call issues a list of `Collective`s: the op, the message size `S` by
`minispeed.comm.costs`' convention (all-gather: the gathered output; reduce-scatter: the unreduced
input) and whether forward or backward issues it. The bytes a rank puts on the wire follow from
`minispeed.comm.costs.wire_bytes` (all-reduce 2(n-1)/n · S, all-gather and reduce-scatter
(n-1)/n · S). Symbols: `M` tokens of the whole sequence (B · T), `K` input features, `N` output
features (whole layer, before the split), `C` the embedding width, `e` bytes per element, `n` the
group size. With `n == 1` nothing is issued.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Collective",
    "column_collectives",
    "cross_entropy_collectives",
    "embedding_collectives",
    "row_collectives",
]


@dataclass(frozen=True)
class Collective:
    """One collective a layer call issues."""

    op: str
    """`all_reduce`, `all_gather` or `reduce_scatter` (names of `minispeed.comm.costs.OPS`)."""
    msg_bytes: int
    """Message size S (see the module docstring)."""
    phase: str
    """`"forward"` or `"backward"`."""


def column_collectives(
    M: int, K: int, N: int, n: int, e: int = 4, *, gather_output: bool = False,
    sequence_parallel: bool = False, input_grad: bool = True,
) -> list[Collective]:  # fmt: skip
    """`ColumnParallelLinear` (weight `(N/n, K)` per rank) on `M` tokens.

    - plain: backward all-reduces the input gradient, `4·M·K` bytes (fp32); forward is free;
    - `gather_output`: forward also all-gathers the output, `e·M·N`; its backward is a slice;
    - `sequence_parallel`: forward all-gathers the input's sequence shards (`e·M·K`); backward
      all-gathers them again (they are kept as shards, Megatron-SP's saving) and reduce-scatters
      the input gradient (`e·M·K` each), in place of the all-reduce.

    `input_grad=False` (the input needs no gradient, e.g. the first layer) drops the backward
    all-reduce / reduce-scatter.
    """
    if n == 1:
        return []
    out: list[Collective] = []
    if sequence_parallel:
        out.append(Collective("all_gather", e * M * K, "forward"))
    if gather_output:
        out.append(Collective("all_gather", e * M * N, "forward"))
    if sequence_parallel:
        out.append(Collective("all_gather", e * M * K, "backward"))
        if input_grad:
            out.append(Collective("reduce_scatter", e * M * K, "backward"))
    elif input_grad:
        out.append(Collective("all_reduce", e * M * K, "backward"))
    return out


def row_collectives(
    M: int, K: int, N: int, n: int, e: int = 4, *, input_is_parallel: bool = True,
    sequence_parallel: bool = False, bias: bool = True,
) -> list[Collective]:  # fmt: skip
    """`RowParallelLinear` (weight `(N, K/n)` per rank) on `M` tokens.

    - plain: forward all-reduces the partial outputs, `e·M·N`; backward is free;
    - `input_is_parallel=False`: backward all-gathers the input gradient, `e·M·K`;
    - `sequence_parallel`: forward reduce-scatters the partial outputs (`e·M·N`), backward
      all-gathers the output gradient (`e·M·N`); the bias, added to sequence shards, gets a
      partial gradient on each rank: one all-reduce of `e·N` sums it.
    """
    if n == 1:
        return []
    if sequence_parallel:
        out = [Collective("reduce_scatter", e * M * N, "forward")]
        if bias:
            out.append(Collective("all_reduce", e * N, "backward"))
        out.append(Collective("all_gather", e * M * N, "backward"))
    else:
        out = [Collective("all_reduce", e * M * N, "forward")]
    if not input_is_parallel:
        out.append(Collective("all_gather", e * M * K, "backward"))
    return out


def embedding_collectives(
    M: int, C: int, n: int, e: int = 4, *, sequence_parallel: bool = False
) -> list[Collective]:
    """`VocabParallelEmbedding` (rows `V/n` per rank) on `M` tokens: each rank looks up the ids it
    holds (zeros elsewhere), then forward all-reduces `e·M·C` bytes; backward is free (each rank's
    rows get their own gradient). Under sequence parallelism forward reduce-scatters the `e·M·C`
    bytes instead, and backward all-gathers the gradient's sequence shards (`e·M·C`): every rank
    needs the whole `(M, C)` gradient for its rows."""
    if n == 1:
        return []
    if sequence_parallel:
        return [
            Collective("reduce_scatter", e * M * C, "forward"),
            Collective("all_gather", e * M * C, "backward"),
        ]
    return [Collective("all_reduce", e * M * C, "forward")]


def cross_entropy_collectives(M: int, n: int, e: int = 4) -> list[Collective]:
    """`vocab_parallel_cross_entropy` on `M` tokens: forward all-reduces the row maxima (`e·M`,
    op MAX), then the target logits and the sums of exponentials together (`2·e·M`); backward is
    free. The `(M, V)` logits never exist on one rank: each keeps `(M, V/n)`."""
    if n == 1:
        return []
    return [
        Collective("all_reduce", e * M, "forward"),
        Collective("all_reduce", 2 * e * M, "forward"),
    ]
