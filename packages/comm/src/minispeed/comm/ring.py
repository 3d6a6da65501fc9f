"""A ring reduce-scatter over point-to-point messages, for backends whose own reduce-scatter is an
all-reduce (gloo: Note [gloo's reduce-scatter is an all-reduce] in api_compat.py).

**Note [ring reduce-scatter over p2p]**

The input is n chunks of m elements; rank r must end with the sum of every rank's chunk r. In
n-1 steps around the ring (rank r sends to r+1 and receives from r-1), step k (k = 0 .. n-2):

- rank r sends its partial sum of chunk (r-k-1) mod n (at k = 0, its own chunk);
- it receives rank r-1's partial sum of chunk (r-k-2) mod n into an m-element scratch and adds
  its own chunk (r-k-2) mod n to it.

After the last step chunk (r-n) mod n = r holds all n contributions. Each rank sends n-1 chunks:
(n-1)/n · S bytes, half of what the all-reduce that torch's gloo runs instead sends, and keeps
one m-element scratch (S/n) while in flight (none out of place on 2 ranks: the one step receives
into `output`). Where the partial sums live:

- in place (`output` is this rank's chunk of `input`, ZeRO's buckets): in `input`'s chunks
  themselves, which the caller gave up as scratch (Note [in-place flat collectives]);
- out of place: in `output` and the scratch, alternately, so the last sum lands in `output` and
  `input` stays as it was.

Numerics: chunk c is summed in ring order, ((x_{c+1} + x_{c+2}) + ...) + x_c. With 2 ranks that
is one addition, which is commutative: the result is bit-equal to any all-reduce's. With more
ranks the order may differ from the backend's all-reduce in the last bits (each chunk is still
summed in one fixed order, the same on every run).

An async call issues step 0 and returns; the later steps need the earlier ones' sums, so they run
in `wait()` (with 2 ranks there are none: the whole exchange overlaps with the caller's work).
Every step's tensors are lent to the backend (`minispeed.comm.handoff`) and returned before the
call (or its `wait()`) returns. Only SUM is run this way (`SUPPORTED_OPS`).

Reference: `torch.distributed.reduce_scatter_tensor` on a backend with a native reduce-scatter
(the tests compare with a sum of every rank's input).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from minispeed.comm.api_compat import Issued
from minispeed.comm.handoff import Loan, lend

__all__ = ["SUPPORTED_OPS", "RingWork", "reduce_scatter_ring"]

SUPPORTED_OPS = (dist.ReduceOp.SUM,)


def reduce_scatter_ring(
    output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool
) -> Issued:
    """SUM-reduce-scatter 1-D `input` (n·m elements) into 1-D `output` (m) by the ring of Note
    [ring reduce-scatter over p2p]: (n-1)/n · S bytes sent per rank, one m-element scratch.

    In place when `output` is this rank's chunk of `input` (the other chunks become scratch). Must
    be called inside the caller's `Loan` (step 0's tensors are lent to it). Returns the backend
    work (a `RingWork` when `async_op`, else None, everything done) and no finishing step.
    """
    if dist.get_world_size(group) == 1:  # nothing to send: the sum is the input
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)
        return None, None
    work = RingWork(output, input, group)
    work.step()  # step 0, lent to the caller's loan
    if async_op:
        return work, None
    work.wait()
    return None, None


class RingWork:
    """The steps of one ring reduce-scatter; `wait()` finishes the step in flight and runs the rest."""

    __slots__ = ("_chunks", "_in_place", "_k", "_next", "_output", "_pending", "_prev")
    __slots__ += ("_scratch", "_n", "_rank", "_group")

    def __init__(self, output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
        n, me = dist.get_world_size(group), dist.get_rank(group)
        self._n, self._rank, self._group = n, me, group
        self._chunks = input.view(n, -1)
        self._in_place = output.data_ptr() == self._chunks[me].data_ptr()
        self._output = output
        # Allocated at first use: out of place on 2 ranks the one step receives into `output`.
        self._scratch: torch.Tensor | None = None
        ranks = [(me + 1) % n, (me - 1) % n]
        if group is not None:
            ranks = [dist.get_global_rank(group, p) for p in ranks]
        self._next, self._prev = ranks
        self._k = 0  # the step in flight, or the next one to issue
        # (works of the step in flight, the buffer it receives into, the chunk added to it)
        self._pending: tuple[list[Any], torch.Tensor, int] | None = None

    def _buffers(self, k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """What step k sends, the buffer it receives into, and which own chunk is added there."""
        n, me = self._n, self._rank
        c = (me - k - 2) % n  # the chunk received at step k
        if self._in_place:  # partial sums live in the input's chunks; receive into the scratch
            return self._chunks[(me - k - 1) % n], self._scratch_buffer(), c
        # out of place: receive into output and scratch alternately, the last step into output
        send = self._chunks[(me - 1) % n] if k == 0 else self._received(k - 1)
        return send, self._received(k), c

    def _received(self, k: int) -> torch.Tensor:
        """Out of place: the buffer step k receives into."""
        return self._output if (self._n - 2 - k) % 2 == 0 else self._scratch_buffer()

    def _scratch_buffer(self) -> torch.Tensor:
        if self._scratch is None:
            self._scratch = torch.empty_like(self._output)
        return self._scratch

    def step(self) -> None:
        """Issue step `k` (inside an open Loan)."""
        send, recv, c = self._buffers(self._k)
        ops = [
            dist.P2POp(dist.isend, lend(send), self._next, self._group),
            dist.P2POp(dist.irecv, lend(recv), self._prev, self._group),
        ]
        self._pending = (dist.batch_isend_irecv(ops), recv, c)

    def _complete(self) -> None:
        """Wait for the step in flight and add this rank's chunk into what it received."""
        works, recv, c = self._pending
        for w in works:
            w.wait()
        self._pending = None
        if self._in_place:
            self._chunks[c].add_(recv)
        else:
            recv.add_(self._chunks[c])
        self._k += 1

    def wait(self, timeout: Any = None) -> bool:
        """Run the ring to its end: the reduced chunk is then in `output`."""
        if self._pending is not None:
            self._complete()
        while self._k < self._n - 1:
            loan = Loan()
            try:
                with loan:
                    self.step()
                self._complete()
            except RuntimeError:
                loan.settle(block=False)  # a failed op: the backend may hold them until torn down
                raise
            loan.settle()
        return True

    def is_completed(self) -> bool:
        """Whether every step has been received and added (only `wait()` adds them)."""
        return self._pending is None and self._k >= self._n - 1
