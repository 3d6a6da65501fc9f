"""Bytes on the wire of every compressed collective, written once (STYLE habit 11).

Each `*_calls` function lists the collectives one call issues as `(op, msg_bytes)` pairs in
the comms logger's convention (all_gather: gathered bytes; all_to_all: input bytes; see
`minispeed.comm.costs`). `wire_bytes` prices such a list with
`minispeed.comm.costs.wire_bytes`, so tests compare the logger's ledger with the same
numbers the docs quote. `n` is the group size, `N` the elements reduced.

| collective | calls (msg bytes) | bytes one rank sends |
|---|---|---|
| fp32 all-reduce | all_reduce 4N | 2(n-1)/n · 4N |
| 1-bit all-reduce | all_to_all n·m, all_gather n·m | 2(n-1) · m,  m = 4 + C/8 |
| top-k all-reduce | all_gather n·8k | (n-1) · 8k |
| quantized all-gather | all_gather n·q | (n-1) · q |
| quantized reduce-scatter | all_to_all n·q | (n-1) · q |

with `C = 8 ceil(N / 8n)` the 1-bit chunk (each rank's share, padded to whole bytes),
`k` the kept elements per rank, and `q = ceil(P bits / 8) + 4 P / B` the packed bytes of one
rank's part padded to `P = B ceil(S / B)` elements (S = shard elements, B = block).
1-bit versus fp32: `2(n-1)/n · 4N / (2(n-1)(4 + C/8)) = 32 / (1 + 32/C)` ≈ 32x for large C.
"""

from __future__ import annotations

from minispeed.comm import costs
from minispeed.comm.compression.quantize import BlockQuantizer
from minispeed.comm.compression.topk import TopkCompressor

__all__ = [
    "Calls",
    "dense_allreduce_calls",
    "onebit_allreduce_calls",
    "onebit_chunk_numel",
    "quantized_all_gather_calls",
    "quantized_reduce_scatter_calls",
    "topk_allreduce_calls",
    "wire_bytes",
]

#: `[(op, msg_bytes), ...]` in the order the collective issues them.
Calls = list[tuple[str, int]]


def _check(numel: int, n: int) -> None:
    if numel < 0 or n < 1:
        raise ValueError(f"need numel >= 0 and group size >= 1, got numel={numel}, n={n}")


def wire_bytes(calls: Calls, n: int) -> int:
    """Bytes one rank sends for `calls` on a group of `n` (ring / pairwise algorithms)."""
    return sum(costs.wire_bytes(op, msg, n) for op, msg in calls)


def dense_allreduce_calls(numel: int, n: int, element_bytes: int = 4) -> Calls:
    """The uncompressed baseline: one all_reduce of `numel * element_bytes`."""
    _check(numel, n)
    return [("all_reduce", numel * element_bytes)]


def onebit_chunk_numel(numel: int, n: int) -> int:
    """Elements of each rank's chunk in the 1-bit all-reduce: `8 ceil(numel / 8n)`, at least 8."""
    _check(numel, n)
    return max(8, 8 * -(-numel // (8 * n)))


def onebit_allreduce_calls(numel: int, n: int) -> Calls:
    """1-bit all-reduce: each rank sends every other rank one `4 + C/8`-byte message, twice."""
    chunk = onebit_chunk_numel(numel, n)
    message = 4 + chunk // 8  # one fp32 scale + C sign bits
    return [("all_to_all", n * message), ("all_gather", n * message)]


def topk_allreduce_calls(numel: int, n: int, compressor: TopkCompressor) -> Calls:
    """Top-k all-reduce: one all_gather of every rank's `8 k` bytes."""
    _check(numel, n)
    return [("all_gather", n * compressor.packed_nbytes(numel))]


def quantized_all_gather_calls(shard_numel: int, n: int, quantizer: BlockQuantizer) -> Calls:
    """Quantized all-gather (qwZ) of `shard_numel` elements per rank."""
    _check(shard_numel, n)
    return [("all_gather", n * quantizer.packed_nbytes(quantizer.padded_numel(shard_numel)))]


def quantized_reduce_scatter_calls(shard_numel: int, n: int, quantizer: BlockQuantizer) -> Calls:
    """Quantized reduce-scatter (qgZ) to `shard_numel` elements per rank, via one all_to_all."""
    _check(shard_numel, n)
    return [("all_to_all", n * quantizer.packed_nbytes(quantizer.padded_numel(shard_numel)))]
