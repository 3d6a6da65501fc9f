"""Stage-3 gradients: reduce-scatter each parameter's gradient into this rank's fp32 shard.

A parameter's full gradient exists only briefly: autograd accumulates it into ``param.grad``
(full shape, parameter dtype) while the parameter is gathered for backward; a
``register_post_accumulate_grad_hook`` then moves it into a bucket and drops ``param.grad``.
When the bucket is complete (``ZeroConfig.bucket_numel``: ``reduce_bucket_numel``, at most
25 MiB) it is reduce-scattered (async with ``overlap_comm``, so it travels while backward
computes the layers below); rank r receives row r,
its shard of every gradient in the bucket, divided by N. The first micro-step of a window makes
each ``grad_shard`` a view of that received row (no copy, no zero-filled buffer waiting through
forward); later micro-steps add into it. ``zero_grad`` drops the shards (``grad_shard = None``),
as ``optimizer.zero_grad(set_to_none=True)`` does, so between the step and the next backward, and
through the whole forward, a rank holds no gradient bytes at all. See Note [lazy gradient shards].

Bucket layout (the reduce-scatter input must be rank-major: row r is what rank r receives):

```text
gradient of a (n=7, N=2, s=4):   a0 a1 a2 a3 | a4 a5 a6 0      -> rows of a: (2, 4)
gradient of b (n=4, s=2):        b0 b1 | b2 b3                 -> rows of b: (2, 2)
bucket = cat(rows, dim=1):       row 0: a0 a1 a2 a3 b0 b1      (2, 6) -> rank 0 gets row 0
                                 row 1: a4 a5 a6 0  b2 b3                 rank 1 gets row 1
```

Note [a fixed bucket plan]
Collectives are matched across ranks by the order they are issued, so every rank must cut its
gradients into the same buckets and launch them in the same order, even when a parameter gets a
gradient on one rank and not on another (``if rank == 0: h = h * self.extra``). Buckets are
therefore planned once, identically on every rank, from the parameters' registration order
reversed (the order backward usually produces them); a bucket is launched when all of its
parameters have arrived and every bucket before it is launched, and the buckets still incomplete
when backward ends are launched then, a missing gradient counting as zeros. (Bucketing by arrival
order, as this module first did, sent reduce-scatters of different sizes in that case and gloo
aborted the process.) A parameter no rank used gets a zero gradient shard; the optimizer still
skips it (Note [unused parameters] in optimizer.py).

Note [lazy gradient shards]
The gradient shards (``Σ s·g`` bytes) are needed from the reduction of a parameter's gradient until
the optimizer step. Allocating them once and zeroing them after each step (as this module first
did) keeps them through the forward and the start of backward, which is exactly when activations
peak: on the benchmark's GPT that was 6 MiB of a 70 MiB peak per rank that FSDP2 does not pay
(it also creates sharded gradients during backward). Now they appear bucket by bucket as
backward proceeds, while activations are being freed.

Costs: bytes kept: ``Σ s·g`` for the shards, from the first reduction of a window to the step,
as views of each bucket's averaged row; while in flight, at most ``_MAX_IN_FLIGHT + 1`` buckets of
``≤ reduce_bucket_numel`` elements, each reduced in place and freed as soon as its reduction is
seen complete (plus the full gradients of the buckets being filled). Bytes sent per micro-step:
one reduce-scatter message of ``Σ N·s·g`` over the trained parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.comm.buckets import InFlight, LaunchQueue
from minispeed.core import ranges
from minispeed.zero.flat import cut_runs
from minispeed.zero.reducer import weak_hook
from minispeed.zero.stage3.params import ShardedParam

__all__ = ["GradShardReducer", "keep_grad_shard"]

# Reduce-scatters in flight before the next launch waits for the oldest: bounds staging memory.
_MAX_IN_FLIGHT = 2


def keep_grad_shard(sp: ShardedParam, mine: torch.Tensor) -> None:
    """The reducer's default sink: keep this rank's averaged shard as ``sp.grad_shard`` (a view
    at the window's first micro-step: Note [lazy gradient shards]; added to it after)."""
    if sp.grad_shard is None:
        sp.grad_shard = mine
    else:
        sp.grad_shard.add_(mine)


class GradShardReducer:
    """Owns the stage-3 gradient shards and the hooks that fill them.

    The launch order and the window of reductions in flight are `comm.LaunchQueue`'s (the same
    helper stages 0-2 use); this class decides what a bucket is and where its result goes.
    """

    def __init__(
        self,
        sps: list[ShardedParam],
        group: Any,
        *,
        bucket_numel: int,
        grad_dtype: torch.dtype,
        overlap: bool,
        position: dict[ShardedParam, int] | None = None,
        reduce_scatter: Any = None,
    ) -> None:
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.bucket_numel = bucket_numel
        self.grad_dtype = grad_dtype
        self.overlap = overlap
        # comm.reduce_scatter_tensor, or ZeRO++'s quantized two-hop one (stage3/zeropp_grads.py)
        self.reduce_scatter = reduce_scatter or comm.reduce_scatter_tensor
        # Where each reduced shard goes, sink(sp, averaged_shard): kept as ``sp.grad_shard``, or
        # ZeRO-Infinity's (stage3/infinity.py), to a swap file. Chosen once, at zero.shard.
        self.sink: Any = keep_grad_shard
        # A frozen parameter never gets a gradient and is never reduced.
        sps = [sp for sp in sps if sp.param.requires_grad]
        self._by_param: dict[nn.Parameter, ShardedParam] = {sp.param: sp for sp in sps}
        for sp in sps:
            sp.grad_shard = None  # created by the first reduction: Note [lazy gradient shards]
        # Note [a fixed bucket plan]: registration order reversed, cut at bucket_numel elements.
        rank_of = position or {sp: k for k, sp in enumerate(sps)}
        backwards = sorted(sps, key=lambda sp: -rank_of[sp])
        sizes = [self.world_size * sp.shard_numel for sp in backwards]  # reduce-scatter input
        self._plan: list[list[ShardedParam]] = cut_runs(backwards, sizes, bucket_numel)
        self._bucket_of = {sp: b for b, run in enumerate(self._plan) for sp in run}
        # [b]: the (N, s) gradients of bucket b that arrived in this backward, until its launch.
        self._rows: list[dict[ShardedParam, torch.Tensor]] = [{} for _ in self._plan]
        self._queue = LaunchQueue(
            [len(run) for run in self._plan],
            self._launch,
            max_in_flight=_MAX_IN_FLIGHT if overlap else None,
        )
        # Weak: see Note [hooks hold their owner weakly] (reducer.py).
        self._handles = [
            sp.param.register_post_accumulate_grad_hook(weak_hook(self._on_grad)) for sp in sps
        ]

    def _on_grad(self, param: nn.Parameter) -> None:
        sp = self._by_param[param]
        grad = param.grad
        param.grad = None  # the bucket holds it now; the full gradient is freed after the launch
        b = self._bucket_of[sp]
        self._queue.reap()  # free finished buckets' inputs while backward goes on
        if self._queue.launched(b):
            raise RuntimeError(
                f"parameter {sp.name!r} received a second gradient in one backward, after its "
                f"bucket was reduced. Call backward once per micro-step through "
                f"ZeroOptimizer.backward(loss) (sum several losses first), and use "
                f"non-reentrant activation checkpointing (use_reentrant=False)"
            )
        rows = sp.grad_by_rank(grad, self.grad_dtype)
        arrived = self._rows[b]
        if sp in arrived:  # a second gradient before the launch: accumulate (a copy)
            arrived[sp] = arrived[sp] + rows
            return
        arrived[sp] = rows
        self._queue.arrived(b)

    def _launch(self, b: int) -> InFlight:
        """Reduce-scatter bucket ``b``: its gradients side by side, missing ones as zeros."""
        self._queue.reap()
        arrived, self._rows[b] = self._rows[b], {}
        offsets, rows, col = [], [], 0
        for sp in self._plan[b]:
            offsets.append((sp, col))
            col += sp.shard_numel
            got = arrived.pop(sp, None)
            if got is None:  # no gradient on this rank: zeros (Note [a fixed bucket plan])
                got = torch.zeros(
                    self.world_size, sp.shard_numel, dtype=self.grad_dtype, device=sp.shard.device
                )
            rows.append(got)
        staged = torch.cat(rows, dim=1) if len(rows) > 1 else rows[0].contiguous()  # (N, cols)
        del rows  # the full gradients are freed now (unless staged is one of them, uncopied)
        # In place: this rank's row of the input receives the reduced row (Note [in-place flat
        # collectives], comm/api_compat.py), so a bucket in flight holds N·cols elements, not more.
        with ranges.range("zero3.reduce_scatter"):
            work = self.reduce_scatter(
                staged[self.rank], staged.view(-1), group=self.group, async_op=self.overlap
            )
        return InFlight(work, lambda: self._deliver(staged, offsets), (staged,))

    def _deliver(self, staged: torch.Tensor, offsets: list[tuple[ShardedParam, int]]) -> None:
        """The reduction of a bucket completed: average this rank's row into the gradient shards.

        The average goes to a compact (cols,) tensor of its own, so the N·cols input is freed
        with the bucket's record, and the gradient shards made below are views of it.
        """
        out = staged[self.rank].mul(1.0 / self.world_size)
        for sp, col in offsets:
            self.sink(sp, out[col : col + sp.shard_numel])

    def flush(self) -> None:
        """Launch the buckets still incomplete (missing gradients as zeros), in plan order, and
        wait for every reduction (end of a micro-step)."""
        self._queue.flush()
        self._queue.reset()

    def wait_in_flight(self) -> None:
        """Wait for the reductions already issued; launch nothing (closing)."""
        self._queue.wait_all()

    def zero_grad(self) -> None:
        """Drop every gradient shard (start of an accumulation window): frees ``Σ s·g`` bytes."""
        for sp in self._by_param.values():
            sp.grad_shard = None

    def grad_of(self, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s averaged gradient shard; zeros (allocated now) if it received none."""
        if sp.grad_shard is None:
            sp.grad_shard = torch.zeros(
                sp.shard_numel, dtype=self.grad_dtype, device=sp.shard.device
            )
        return sp.grad_shard

    def remove(self) -> None:
        """Remove the gradient hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
