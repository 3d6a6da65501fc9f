"""Stage-3 gradients: reduce-scatter each parameter's gradient into this rank's fp32 shard.

A parameter's full gradient exists only briefly: autograd accumulates it into ``param.grad``
(full shape, parameter dtype) while the parameter is gathered for backward; a
``register_post_accumulate_grad_hook`` then moves it into a bucket and drops ``param.grad``.
When the bucket holds ``reduce_bucket_numel`` elements it is reduce-scattered (async with
``overlap_comm``, so it travels while backward computes the layers below); rank r receives row r,
its shard of every gradient in the bucket, divided by N. The first micro-step of a window makes
each ``grad_shard`` a view of that received row (no copy, no zero-filled buffer waiting through
forward); later micro-steps add into it. ``zero_grad`` drops the shards (``grad_shard = None``),
as ``optimizer.zero_grad(set_to_none=True)`` does, so between the step and the next backward, and
through the whole forward, a rank holds no gradient bytes at all. See Note [lazy gradient shards].

Bucket layout (the reduce-scatter input must be rank-major: row r is what rank r receives)::

    gradient of a (n=7, N=2, s=4):   a0 a1 a2 a3 | a4 a5 a6 0      -> rows of a: (2, 4)
    gradient of b (n=4, s=2):        b0 b1 | b2 b3                 -> rows of b: (2, 2)
    bucket = cat(rows, dim=1):       row 0: a0 a1 a2 a3 b0 b1      (2, 6) -> rank 0 gets row 0
                                     row 1: a4 a5 a6 0  b2 b3                 rank 1 gets row 1

A parameter that receives no gradient (unused in this forward) is never bucketed; its shard stays
as it was (``None``, i.e. zero, after ``zero_grad``). Buckets are filled in gradient-arrival order, which autograd
makes identical on every rank when every rank ran the same modules (checked by the coordinator).

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
seen complete (plus the full gradients of the one being filled). Bytes sent per micro-step:
one reduce-scatter message of ``Σ N·s·g`` over the parameters that got a gradient.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.zero.reducer import weak_hook
from minispeed.zero.stage3.params import ShardedParam

__all__ = ["GradShardReducer"]

# Reduce-scatters in flight before the next launch waits for the oldest: bounds staging memory.
_MAX_IN_FLIGHT = 2


def _completed(work: Any) -> bool:
    return work is None or work.is_completed()


class GradShardReducer:
    """Owns the stage-3 gradient shards and the hooks that fill them."""

    def __init__(
        self,
        sps: list[ShardedParam],
        group: Any,
        *,
        bucket_numel: int,
        grad_dtype: torch.dtype,
        overlap: bool,
    ) -> None:
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.bucket_numel = bucket_numel
        self.grad_dtype = grad_dtype
        self.overlap = overlap
        self._by_param: dict[nn.Parameter, ShardedParam] = {sp.param: sp for sp in sps}
        for sp in sps:
            sp.grad_shard = None  # created by the first reduction: Note [lazy gradient shards]
        self._bucket: list[tuple[ShardedParam, torch.Tensor]] = []  # (param, (N, s) rows)
        self._bucket_cols = 0  # Σ s of the bucket: elements each rank will receive
        self._in_flight: deque[tuple[Any, list[tuple[ShardedParam, int]], torch.Tensor]]
        self._in_flight = deque()
        self.launched_numels: list[int] = []  # reduce-scatter input elements, in launch order
        # Weak: see Note [hooks hold their owner weakly] (reducer.py).
        self._handles = [
            sp.param.register_post_accumulate_grad_hook(weak_hook(self._on_grad)) for sp in sps
        ]

    def _on_grad(self, param: nn.Parameter) -> None:
        sp = self._by_param[param]
        grad = param.grad
        param.grad = None  # the bucket holds it now; the full gradient is freed after the launch
        if (
            self._bucket
            and (self._bucket_cols + sp.shard_numel) * self.world_size > self.bucket_numel
        ):
            self._launch()
        self._bucket.append((sp, sp.grad_by_rank(grad, self.grad_dtype)))
        self._bucket_cols += sp.shard_numel
        if self._bucket_cols * self.world_size >= self.bucket_numel:
            self._launch()

    def _launch(self) -> None:
        if not self._bucket:
            return
        bucket = self._bucket
        self._bucket, self._bucket_cols = [], 0
        # Finish what already arrived before staging the next bucket: a completed reduction's
        # input buffer is dead weight until _finish_oldest drops it.
        while self._in_flight and _completed(self._in_flight[0][0]):
            self._finish_oldest()
        offsets, col = [], 0
        for sp, _ in bucket:
            offsets.append((sp, col))
            col += sp.shard_numel
        rows = [r for _, r in bucket]
        del bucket
        staged = torch.cat(rows, dim=1) if len(rows) > 1 else rows[0].contiguous()  # (N, cols)
        del rows  # the full gradients are freed now (unless staged is one of them, uncopied)
        self.launched_numels.append(staged.numel())
        # In place: this rank's row of the input receives the reduced row (Note [in-place flat
        # collectives], comm/api_compat.py), so a bucket in flight holds N·cols elements, not more.
        work = comm.reduce_scatter_tensor(
            staged[self.rank], staged.view(-1), group=self.group, async_op=self.overlap
        )
        self._in_flight.append((work, offsets, staged))
        if not self.overlap or len(self._in_flight) > _MAX_IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        work, offsets, staged = self._in_flight.popleft()
        if work is not None:
            work.wait()
        # The average, in a compact (cols,) tensor of its own: the N·cols input is freed with this
        # frame, and the gradient shards made below are views of ``out``.
        out = staged[self.rank].mul(1.0 / self.world_size)
        del staged
        for sp, col in offsets:
            mine = out[col : col + sp.shard_numel]
            if sp.grad_shard is None:  # first micro-step of the window: keep the view
                sp.grad_shard = mine
            else:
                sp.grad_shard.add_(mine)

    def flush(self) -> None:
        """Launch the partly filled bucket and wait for every reduction (end of a micro-step)."""
        self._launch()
        while self._in_flight:
            self._finish_oldest()

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
