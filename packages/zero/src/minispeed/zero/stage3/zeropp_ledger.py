"""ZeRO++'s communication ledger: bytes per micro-step on each axis, as formulas the tests check.

Axes of N = M nodes × k ranks (node-major): a collective runs on the ``world`` group (spans every
node), on an ``intra`` group (the k ranks of one node) or on an ``inter`` group (the M ranks with
one local index, one per node); `axis_of` classifies a comms-logger record by its ranks.
Message sizes follow the logger (all-gather: gathered output; reduce-scatter and all-to-all:
input). Per non-persistent parameter of ``n`` elements, ``s = ceil(n/N)``, p bytes per parameter
element, B = ``quant_block_numel``, ``P(x) = B·ceil(x/B)``, ``q_b(x) = x·b/8 + 4x/B``:

| when | plain stage 3 | with ZeRO++ |
|---|---|---|
| forward all-gather | world, ``N·s·p`` | qwZ: world, uint8 ``N·q_8(P(s))`` |
| backward all-gather | world, ``N·s·p`` | hpZ: intra, ``N·s·p``; else as forward |
| gradient reduce-scatter, per bucket of c columns (``Σ s`` of its parameters) | world, ``N·c·g`` | qgZ: intra all-to-all ``q_b(N·P(c))`` + inter all-to-all ``q_b(M·P(c))`` |

(With k = 1 qgZ has no intra hop, with M = 1 no inter hop.) Plus the trace check of every stage-3
forward (int64, world) and the persistent parameters' exact re-gather after the step.

**Bytes across the node boundary** (`cross_node_bytes`), ring model: a ring collective on a
group sends each rank's ``wire_bytes`` to the next rank of the group, so a rank's bytes cross a
node boundary iff its successor is on another node (on the world ring, M of the N ranks); an
all-to-all sends ``msg/|G|`` to each peer, crossing for each peer on another node.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from minispeed.comm import CommRecord
from minispeed.comm.compression import BlockQuantizer

__all__ = [
    "ZeroPPStepBytes",
    "axis_of",
    "bytes_by_axis",
    "cross_node_bytes",
    "mics_step_bytes",
    "zeropp_step_bytes",
]


def axis_of(ranks: Sequence[int], node_size: int) -> str:
    """``"intra"`` (one node), ``"inter"`` (one rank per node, several nodes) or ``"world"``."""
    nodes = [r // node_size for r in ranks]
    if len(set(nodes)) <= 1:
        return "intra"
    if len(set(nodes)) == len(nodes):
        return "inter"
    return "world"


@dataclass(frozen=True)
class ZeroPPStepBytes:
    """Message bytes of one steady-state micro-step, keyed ``(op, axis)`` (see the table)."""

    forward: dict[tuple[str, str], int]
    backward: dict[tuple[str, str], int]

    def total(self) -> dict[tuple[str, str], int]:
        """Forward and backward together."""
        out = dict(self.forward)
        for key, value in self.backward.items():
            out[key] = out.get(key, 0) + value
        return out


def zeropp_step_bytes(
    numels: Sequence[int],
    world_size: int,
    node_size: int,
    *,
    persistence_threshold_numel: int,
    param_bytes: int,
    grad_bytes: int,
    bucket_columns: Sequence[int],
    quantized_weights: bool = False,
    hpz: bool = False,
    quantized_gradients: bool = False,
    block_numel: int = 256,
    gradient_bits: int = 8,
) -> ZeroPPStepBytes:
    """The module docstring's table summed over parameters (trace check and persistent re-gather
    excluded). ``bucket_columns``: per gradient bucket, ``Σ ceil(n/N)`` of its parameters (one
    bucket of every trained parameter when ``reduce_bucket_numel`` exceeds the model)."""
    n, k = world_size, node_size
    m = n // k
    shards = [-(-x // n) for x in numels if x > persistence_threshold_numel]
    w8 = BlockQuantizer(8, block_numel)
    fwd_gather = (
        ("all_gather", "world", sum(n * w8.packed_nbytes(w8.padded_numel(s)) for s in shards))
        if quantized_weights
        else ("all_gather", "world", sum(n * s * param_bytes for s in shards))
    )
    if hpz:
        bwd_gather = ("all_gather", "intra", sum(n * s * param_bytes for s in shards))
    else:
        bwd_gather = fwd_gather
    reduce: dict[tuple[str, str], int] = {}
    if quantized_gradients:
        g = BlockQuantizer(gradient_bits, block_numel)
        for c in bucket_columns:
            p = g.padded_numel(c)
            if k > 1:
                reduce[("all_to_all", "intra")] = reduce.get(
                    ("all_to_all", "intra"), 0
                ) + g.packed_nbytes(n * p)
            if m > 1:
                reduce[("all_to_all", "inter")] = reduce.get(
                    ("all_to_all", "inter"), 0
                ) + g.packed_nbytes(m * p)
    else:
        reduce[("reduce_scatter", "world")] = sum(n * c * grad_bytes for c in bucket_columns)
    backward = {bwd_gather[:2]: bwd_gather[2], **reduce}
    return ZeroPPStepBytes(forward={fwd_gather[:2]: fwd_gather[2]}, backward=backward)


def mics_step_bytes(
    numels: Sequence[int],
    shard_size: int,
    replicas: int,
    *,
    persistence_threshold_numel: int,
    param_bytes: int,
    grad_bytes: int,
    bucket_columns: Sequence[int],
) -> ZeroPPStepBytes:
    """MiCS (stage3/mics.py) on the same axes, with the shard group as the node (``node_size``
    = S in `axis_of`): parameter all-gathers ``S·s·p`` per parameter, ``s = ceil(n/S)``, on the
    shard group (``intra``) in forward and again in backward; per gradient bucket of c columns
    (``Σ s`` of its parameters), a reduce-scatter ``S·c·g`` on the shard group, then (R > 1) an
    all-reduce ``c·g`` on the replica group (``inter``). Trace check and persistent re-gather
    excluded, as in `zeropp_step_bytes`."""
    s_of = [-(-x // shard_size) for x in numels if x > persistence_threshold_numel]
    gather = {("all_gather", "intra"): sum(shard_size * s * param_bytes for s in s_of)}
    backward = dict(gather)
    backward[("reduce_scatter", "intra")] = sum(shard_size * c * grad_bytes for c in bucket_columns)
    if replicas > 1:
        backward[("all_reduce", "inter")] = sum(c * grad_bytes for c in bucket_columns)
    return ZeroPPStepBytes(forward=gather, backward=backward)


def _op_kind(op: str) -> str:
    return "all_gather" if op.startswith("all_gather") else op


def bytes_by_axis(
    records: Iterable[CommRecord], node_size: int, skip_dtypes: Sequence[str] = ("torch.int64",)
) -> dict[tuple[str, str], int]:
    """Sum the records' message bytes per ``(op, axis)``; ``all_gather_coalesced`` counts as
    ``all_gather``. ``skip_dtypes``: the trace check's int64 all-gather by default."""
    out: dict[tuple[str, str], int] = {}
    for r in records:
        if r.dtype in skip_dtypes:
            continue
        key = (_op_kind(r.op), axis_of(r.ranks, node_size))
        out[key] = out.get(key, 0) + r.msg_bytes
    return out


def cross_node_bytes(record: CommRecord, rank: int, node_size: int) -> int:
    """Bytes ``rank`` sent across a node boundary in ``record`` (ring model, module docstring)."""
    ranks = list(record.ranks)
    if rank not in ranks or len(ranks) < 2:
        return 0
    node = rank // node_size
    if _op_kind(record.op) == "all_to_all":
        chunk = record.msg_bytes // len(ranks)
        return chunk * sum(1 for r in ranks if r // node_size != node)
    successor = ranks[(ranks.index(rank) + 1) % len(ranks)]
    return record.wire_bytes if successor // node_size != node else 0
