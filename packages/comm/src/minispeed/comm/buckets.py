"""Gradient buckets: many small reductions as a few large collectives, launched during backward.

The naive version first (STYLE habit 9): `all_reduce_unbucketed` issues one all-reduce per
tensor. With hundreds of parameters that pays the per-call latency (alpha in the alpha-beta
model) hundreds of times and cannot start until backward has finished.

Bucketing instead copies gradients, as backward produces them, into a few flat buffers and
reduces each buffer with one collective as soon as it is complete, so the reduction of the last
layers overlaps the backward of the first ones. *Where* gradients go (which buffer, which
offsets, which collective) belongs to the owner of the buffers (`minispeed.zero`'s reducers for
stages 0-2, its stage-3 gradient shards). What every owner needs alike is `LaunchQueue`:

- **one fixed launch order.** Collectives are matched across ranks by the order they are issued,
  and gradients may arrive in a different order on different ranks (data-dependent control flow,
  a parameter one rank does not use). So buckets are launched strictly in an order fixed when
  the buckets were planned, identical on every rank: a bucket that completes early waits for the
  ones before it, and the buckets still incomplete when backward ends are launched by `flush`
  (their owner fills what never arrived with zeros);
- **a bounded window of collectives in flight** (`max_in_flight`): an owner that stages each
  bucket in a buffer of its own keeps at most that many buffers waiting on the network; the
  oldest is finished (waited on, its result delivered by its `finish` callback, its buffers
  dropped) when the window is full, or earlier by `reap` once it is seen complete.

Costs: none of its own besides one `InFlight` record per collective in flight; the buffers
belong to the owner (`keep`), and bytes sent are the owner's collectives'.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from minispeed.comm import collectives
from minispeed.comm.groups import get_world_size

__all__ = ["InFlight", "LaunchQueue", "all_reduce_unbucketed"]


def all_reduce_unbucketed(
    tensors: Sequence[torch.Tensor], group: Any = None, average: bool = True
) -> None:
    """The naive loop: one synchronous all-reduce per tensor, in place. `len(tensors)` calls."""
    n = get_world_size(group)
    for t in tensors:
        if average:
            t.div_(n)
        collectives.all_reduce(t, group=group)


@dataclass
class InFlight:
    """One launched collective: its handle, what to do once it completed, the buffers it uses."""

    work: Any  # the CommWork handle; None when the call was synchronous (already complete)
    finish: Callable[[], None] | None = None  # delivers the result (runs after the wait)
    keep: tuple[torch.Tensor, ...] = ()  # buffers the collective reads or writes: alive till done


class LaunchQueue:
    """Buckets `0..n-1`, launched in that order as each one's members have all arrived.

    `members[b]` is how many arrivals complete bucket `b` (its parameters' gradients). The owner
    calls `arrived(b)` from its gradient hook; `launch(b)` (the owner's) issues bucket `b`'s
    collective and returns its `InFlight`. Typical use, per backward:

    ```python
    queue = LaunchQueue([len(b.params) for b in plan], launch=issue_bucket, max_in_flight=2)
    # in each gradient hook, after copying the gradient into its bucket:
    queue.arrived(b)
    # after backward:
    queue.flush()   # launch what is left (missing gradients are the owner's zeros), wait for all
    queue.reset()   # next backward
    ```
    """

    def __init__(
        self,
        members: Sequence[int],
        launch: Callable[[int], InFlight],
        max_in_flight: int | None = None,
    ) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 or None, got {max_in_flight}")
        self._members = list(members)
        self.pending = list(members)  # [b]: arrivals bucket b still waits for
        self.next = 0  # the next bucket to launch; buckets < next are launched
        self._launch = launch
        self._max_in_flight = max_in_flight
        self._in_flight: deque[InFlight] = deque()

    def __len__(self) -> int:
        return len(self._members)

    def launched(self, bucket: int) -> bool:
        """Whether `bucket`'s collective was issued in this backward."""
        return bucket < self.next

    def arrived(self, bucket: int, *, launch: bool = True) -> None:
        """One member of `bucket` arrived; with `launch`, issue every bucket now ready in order."""
        self.pending[bucket] -= 1
        # launch_ready's own test, here: most arrivals complete no bucket, and a call per
        # gradient is what a small model's micro-step is made of.
        if launch and self.next < len(self._members) and self.pending[self.next] <= 0:
            self.launch_ready()

    def launch_ready(self, force: bool = False) -> None:
        """Launch buckets in the fixed order while the next one is complete (or `force`)."""
        while self.next < len(self._members) and (force or self.pending[self.next] <= 0):
            bucket = self.next
            self.next += 1
            self._track(self._launch(bucket))

    def _track(self, item: InFlight) -> None:
        if item.work is None:  # synchronous: complete already
            _deliver(item)
            return
        self._in_flight.append(item)
        if self._max_in_flight is not None and len(self._in_flight) > self._max_in_flight:
            self.finish_oldest()

    def finish_oldest(self) -> None:
        """Wait for the oldest collective in flight and deliver its result."""
        item = self._in_flight.popleft()
        item.work.wait()
        _deliver(item)

    def reap(self) -> None:
        """Deliver the collectives already complete, oldest first (one query each, no wait)."""
        while self._in_flight and self._in_flight[0].work.is_completed():
            self.finish_oldest()

    def wait_all(self) -> None:
        """Wait for every collective in flight (launch nothing)."""
        while self._in_flight:
            self.finish_oldest()

    def flush(self) -> None:
        """Launch every bucket not launched yet, in order, then wait for all of them."""
        self.launch_ready(force=True)
        self.wait_all()

    def reset(self) -> None:
        """Start the next backward: every bucket pending again, none launched."""
        self.pending = list(self._members)
        self.next = 0


def _deliver(item: InFlight) -> None:
    if item.finish is not None:
        item.finish()
