"""What comm does when a backend lacks a collective, or runs one worse than we can.

The main path (the torch names, the native call) is in `minispeed.comm.call`; this module holds
the fallbacks it switches to, which backends need them, and the notes on in-place use.

**Note [backend fallbacks]**

Some process-group backends do not implement every flat collective (older gloo builds lack
reduce-scatter; some lack the flat all-gather or all-to-all). A backend that lacks an op raises
before sending anything, and it raises the same way on every rank (same torch build), so we can
catch that error, remember it per backend, and run an equivalent built from ops it does have:

| op | fallback (`impl` logged) | bytes this rank sends instead |
|---|---|---|
| reduce_scatter | `all_reduce+slice` | 2(n-1)/n · S instead of (n-1)/n · S |
| all_gather (flat) | `all_gather_list` | (n-1)/n · S (same), plus a local copy |
| all_to_all (flat) | `p2p` | same bytes, n-1 isend/irecv pairs |

The comms logger records the op under its own name and message size (so busbw stays comparable)
with `impl` naming the fallback and `wire_bytes` the fallback's real cost.

**Note [in-place flat collectives]**

The flat collectives may run in place: for reduce-scatter the output may be this rank's chunk of
the input (`input[r·m : (r+1)·m]`), for all-gather the input may be this rank's chunk of the
output. NCCL documents both; gloo (the CPU backend) gives the same results, and so do both
fallbacks above (the list all-gather copies the input onto itself). After an in-place
reduce-scatter the *other* chunks of the input are scratch: unchanged on NCCL, partial sums after
comm's ring (Note [ring reduce-scatter over p2p] in ring.py), reduced too where the reduce-scatter
is an all-reduce (Note [gloo's reduce-scatter is an all-reduce]); a caller must not read them. `test_in_place_flat_collectives` checks every combination. ZeRO uses it to
keep no separate output buffer: stages 1-3 reduce-scatter gradient buckets in place, and
`all_gather_coalesced` packs its inputs straight into the output.

**Note [gloo's reduce-scatter is an all-reduce]**

torch's gloo backend has no reduce-scatter algorithm of its own: its `reduce_scatter_tensor`
clones the whole input, all-reduces the clone, and copies this rank's chunk out (read in
`ProcessGroupGloo::reduce_scatter_tensor_coalesced`, torch 2.x). So on gloo a reduce-scatter
puts 2(n-1)/n · S bytes on the wire, not (n-1)/n · S, and costs a fresh input-sized buffer plus
two copies per call. comm therefore runs it itself on such a backend, and logs what it runs:

- a SUM (what ZeRO reduces): `ring_p2p`, comm's own ring over point-to-point messages (Note
  [ring reduce-scatter over p2p] in ring.py): (n-1)/n · S on the wire, one S/n scratch, no
  clone; in place or not. Measured on 2 gloo ranks, in place, CPU time per call (all threads,
  mean over ranks) against the all-reduce below: 0.62x at 1 MiB, 0.57x at 4 MiB, 0.81x at 16
  MiB, 0.98x at 64 MiB; on 4 ranks 1.01x, 0.86x, 0.70x, 0.59x (`benchmarks/comm_collectives.py
  --rs-impls 1 4 16 64`, docs/benchmarks.md). With 2 ranks its one addition per element is the
  all-reduce's, so results are bit-equal; with more, each chunk is summed in ring order, which
  may differ from gloo's all-reduce in the last bits.
- any other op, or inside `reduce_scatter_as("all_reduce")` (how comm ran every reduce-scatter
  on gloo before the ring): out of place `all_reduce+slice`, the same clone, all-reduce and copy
  that gloo would do; in place (output = this rank's chunk of the input) `all_reduce_in_place`,
  an all-reduce of the input itself. No clone, no copy: on 2 gloo ranks a 25 MiB bucket took
  27 ms this way against 40 ms through torch's reduce-scatter. Both log the all-reduce's wire
  bytes, which is what the backend sends.

`reduce_scatter_impl` names the implementation a group gets, so ledgers (zero's
`stage_collectives`) price it alike.

**Note [gloo's all-gather is broadcasts]**

torch's gloo backend runs a flat all-gather at several times the CPU cost of moving the same
bytes by broadcast, and from about 64 MiB of output it allocates an output-sized temporary in
every call (16,386 fresh pages at 64 MiB). Measured on 2 gloo ranks, 1 thread each, median CPU
time of the call per rank (broadcasts / `all_gather_single`): 0.7 / 1.5 ms at 4 MiB of output,
3.6-4.2 / 8.7-10.3 ms at 16 MiB, 11-16 / 64-75 ms at 64 MiB; 4 ranks: 6.1 / 10.5 ms at 16 MiB.
So comm runs it on such a backend as n broadcasts, rank j's chunk of the output from rank j
(`all_gather_impl` names it `broadcasts`): received in place, no temporary, no copy when the
input is this rank's chunk already (Note [in-place flat collectives]). Every rank sends its m
elements to the others (a tree forwards some of them), so the group moves (n-1)·S bytes, as
a ring does: the ledger prices it at the ring's (n-1)/n · S per rank. torch's
`ZeroRedundancyOptimizer` publishes its parameters by broadcast for the same reason.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from minispeed.comm.handoff import lend
from minispeed.comm.validation import group_facts

__all__ = [
    "Issued",
    "WorkList",
    "all_gather_impl",
    "all_gather_list",
    "all_to_all_p2p",
    "force_fallback",
    "impl_of",
    "reduce_scatter_by_all_reduce",
    "reduce_scatter_impl",
    "remember_missing",
]

# (backend, op) pairs found missing at run time, plus those forced by tests.
_MISSING: set[tuple[str, str]] = set()
_FORCED: set[str] = set()
_UNSUPPORTED_RE = re.compile(
    r"does not support|not supported|no support|unsupported|not implemented", re.I
)

# What a flat op returns: the backend's Work (None when synchronous) and a function to run after
# it completes (copy results out of a temporary), or None.
Issued = tuple[Any, "Callable[[], None] | None"]


@contextlib.contextmanager
def force_fallback(*ops: str) -> Iterator[None]:
    """Use the fallback of `ops` (`"reduce_scatter"`, `"all_gather"`, `"all_to_all"`) inside
    the block, as if the backend lacked them. For tests of the fallbacks on backends that have the op."""
    added = set(ops) - _FORCED
    _FORCED.update(added)
    try:
        yield
    finally:
        _FORCED.difference_update(added)


def impl_of(op: str, group: Any) -> str:
    """`"native"` or the fallback name that `op` will use on `group`'s backend."""
    if not _FORCED and not _MISSING:  # the common case: no backend lookup
        return "native"
    if op in _FORCED or (_backend(group), op) in _MISSING:
        return _FALLBACK_NAMES[op]
    return "native"


#: Backends whose reduce-scatter is an all-reduce of a copy (Note [gloo's reduce-scatter is an
#: all-reduce]): comm runs a SUM as its own ring over point-to-point messages (`ring_p2p`, Note
#: [ring reduce-scatter over p2p] in ring.py), other ops as an all-reduce.
_REDUCE_SCATTER_BY_RING = frozenset({"gloo"})
_RS_OVERRIDE: list[str] = []  # set by `reduce_scatter_as`, for benchmarks and tests


@contextlib.contextmanager
def reduce_scatter_as(impl: str) -> Iterator[None]:
    """Run gloo's SUM reduce-scatters as `impl` inside the block: `"ring_p2p"` (the default
    choice) or the all-reduce forms (`"all_reduce"`: `all_reduce_in_place` in place, else
    `all_reduce+slice`), main's choice before the ring. For benchmarks comparing the two."""
    if impl not in ("ring_p2p", "all_reduce"):
        raise ValueError(
            f"reduce_scatter_as: unknown impl {impl!r}; use 'ring_p2p' or 'all_reduce'"
        )
    _RS_OVERRIDE.append(impl)
    try:
        yield
    finally:
        _RS_OVERRIDE.pop()


def reduce_scatter_impl(
    group: Any = None,
    output: torch.Tensor | None = None,
    input: torch.Tensor | None = None,
    op: Any = dist.ReduceOp.SUM,
) -> str:
    """The implementation a reduce-scatter gets on `group`'s backend: `"native"`; on gloo, for
    SUM, `"ring_p2p"` ((n-1)/n · S bytes per rank, like a native one); else, where the backend
    lacks it or its own is an all-reduce, `"all_reduce+slice"` or, for an in-place call (`output`
    is this rank's chunk of `input`), `"all_reduce_in_place"`: 2(n-1)/n · S bytes per rank."""
    fallback = impl_of("reduce_scatter", group) != "native"
    if not fallback:
        backend = _backend(group)
        if backend not in _REDUCE_SCATTER_BY_RING:
            return "native"
        if op == dist.ReduceOp.SUM and (not _RS_OVERRIDE or _RS_OVERRIDE[-1] == "ring_p2p"):
            return "ring_p2p"
    if output is not None and input is not None and _is_own_chunk(output, input, group):
        return "all_reduce_in_place"
    return "all_reduce+slice"


#: Backends whose flat all-gather costs more than one broadcast per rank (Note [gloo's all-gather
#: is broadcasts]): comm runs it as broadcasts itself.
_ALL_GATHER_BY_BROADCASTS = frozenset({"gloo"})


def all_gather_impl(group: Any = None) -> str:
    """The implementation a flat all-gather gets on `group`'s backend: `"native"`,
    `"broadcasts"`, or the fallback `"all_gather_list"`; each sends (n-1)/n · S per rank."""
    impl = impl_of("all_gather", group)
    if impl == "native" and _backend(group) in _ALL_GATHER_BY_BROADCASTS:
        return "broadcasts"
    return impl


def _is_own_chunk(output: torch.Tensor, input: torch.Tensor, group: Any) -> bool:
    """Whether `output` is exactly `input[r·m : (r+1)·m]` for this rank r (same storage)."""
    if not (output.is_contiguous() and input.is_contiguous()):
        return False
    m = output.numel()
    offset = dist.get_rank(group) * m * output.element_size()
    return (
        output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr()
        and output.data_ptr() == input.data_ptr() + offset
        and input.numel() == m * dist.get_world_size(group)
    )


_FALLBACK_NAMES = {
    "reduce_scatter": "all_reduce+slice",
    "all_gather": "all_gather_list",
    "all_to_all": "p2p",
}


def _backend(group: Any) -> str:
    return group_facts("backend", group).backend  # learned once per group


def remember_missing(op: str, group: Any, err: RuntimeError) -> bool:
    """Whether `err` says `group`'s backend lacks `op`; if so, remember it for the next calls."""
    if not _UNSUPPORTED_RE.search(str(err)):
        return False
    _MISSING.add((_backend(group), op))
    return True


def reduce_scatter_by_all_reduce(
    output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, async_op: bool
) -> Issued:
    """Fallback `all_reduce+slice`: all-reduce a copy of the whole input, keep this rank's chunk.

    Correct for every reduce op; it sends 2(n-1)/n · S bytes instead of (n-1)/n · S and holds one
    extra input-sized buffer while in flight.
    """
    full = input.detach().clone()  # the caller's input must stay unreduced
    work = dist.all_reduce(lend(full), op=op, group=group, async_op=async_op)
    me = dist.get_rank(group)
    m = output.numel()

    def finish() -> None:
        output.view(-1).copy_(full.view(-1)[me * m : (me + 1) * m])

    return work, finish


def all_gather_list(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
) -> Issued:
    """Fallback `all_gather_list`: the list form of all-gather writing into n views of `output`
    (same bytes on the wire; the backend may copy once more)."""
    chunks = list(output.view(-1).chunk(dist.get_world_size(group)))
    return (
        dist.all_gather(
            [lend(c) for c in chunks], lend(input.reshape(-1)), group=group, async_op=async_op
        ),
        None,
    )


def all_to_all_p2p(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None,
    input_split_sizes: list[int] | None,
    group: Any,
    async_op: bool,
) -> Issued:
    """Fallback `p2p`: one batched isend/irecv per peer plus a local copy of this rank's own
    chunk; the same bytes on the wire."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    ins = _split(input, input_split_sizes, n)
    outs = _split(output, output_split_sizes, n)
    ops = []
    for peer in range(n):
        if peer == me:
            continue
        peer_global = dist.get_global_rank(group, peer) if group is not None else peer
        ops.append(dist.P2POp(dist.isend, lend(ins[peer].contiguous()), peer_global, group))
        ops.append(dist.P2POp(dist.irecv, lend(outs[peer]), peer_global, group))
    outs[me].copy_(ins[me])
    works = dist.batch_isend_irecv(ops) if ops else []
    if not async_op:
        for w in works:
            w.wait()
        return None, None
    return WorkList(works), None


def _split(t: torch.Tensor, sizes: list[int] | None, n: int) -> list[torch.Tensor]:
    if sizes is None:
        return list(t.chunk(n)) if t.shape[0] else [t] * n
    return list(t.split([int(s) for s in sizes]))


class WorkList:
    """Several backend handles waited on as one."""

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)
