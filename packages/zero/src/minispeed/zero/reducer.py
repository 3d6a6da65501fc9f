"""Gradient hooks -> bucketed collectives, running while backward still computes (stages 0-2).

Every managed parameter gets a ``register_post_accumulate_grad_hook``. When autograd has
finished a parameter's gradient, the hook writes it into its bucket's flat buffer (in
``grad_accum_dtype``), frees ``param.grad``, and, once every parameter of the bucket has arrived,
launches the bucket's collective (asynchronously with ``overlap_comm``), so communication of the
last layers overlaps the backward of the first ones.

Three schedules, one per stage:

=========================  ===============================  =====================================
mode                       micro-steps inside a window      the boundary micro-step
=========================  ===============================  =====================================
``ALL_REDUCE`` (stage 0)   accumulate into ``flat_grads``   + all-reduce each bucket in place
``SCATTER_AT_BOUNDARY``    accumulate into ``flat_grads``   + reduce-scatter each bucket in place:
(stage 1)                                                   this rank's shard of it is the result
``SCATTER_EVERY_STEP``     reduce-scatter each bucket into  same
(stage 2)                  ``part_grads`` (accumulating)
=========================  ===============================  =====================================

Bytes kept per rank (g = bytes per ``grad_accum_dtype`` element, Ψ parameters, N ranks):
stage 0 and 1: Ψ·g (full flat gradients; stage 1's reduced partition is this rank's shard of
each bucket, in place); stage 2: Ψ·g/N plus at most ``_MAX_IN_FLIGHT`` + (buckets being filled)
staging buckets of ``reduce_bucket_numel`` elements. Bytes sent: see ``ledger.py``.

Note [the first micro-step overwrites]
The gradient buffers are not zero-filled after a step. The first backward of an accumulation
window *copies* each gradient into its slot (later micro-steps add), and just before a bucket is
reduced (or at the end of a backward that reduces nothing) the slots of parameters that got no
gradient in that first micro-step are zeroed. That is one pass over Ψ per window instead of two
(fill, then add), the way PyTorch DDP copies gradients into its buckets. Stage 2 does the same
with its partition: the first reduced bucket of a window is copied into it, later ones added.

Note [averaging on the way in]
The reduction sums gradients over N ranks; the optimizer wants their mean. Dividing the reduced
buffer afterwards is one more pass over it, Ψ elements for stage 0 (about 0.5 ms per step on the
benchmark's 3.2M-parameter GPT, 0.4 % of a step). So when the hook writes a gradient without a
dtype cast (gradient dtype = ``grad_accum_dtype``) into its bucket, it multiplies by 1/N on the
way (``torch.mul(grad, 1/N, out=slot)``, ``slot.add_(grad, alpha=1/N)``): the same single pass as
a plain copy or add. For N a power of two the result is bit-identical to dividing the sum
(scaling by 2^-k is exact and commutes with rounding); otherwise it differs by rounding. With a
cast (16-bit gradients accumulated in fp32) the mean is still taken after the reduction, in fp32.

Note [bucket launch order]
Collectives are matched across ranks by the order they are issued, and gradients may arrive in a
different order on different ranks (data-dependent control flow, or a parameter no rank uses).
So buckets are launched strictly in one fixed order computed identically on every rank (the
order gradients usually arrive in: last layers first); a bucket that completes early waits for
the ones before it. Buckets still incomplete when backward ends (a parameter got no gradient)
are launched by ``backward_done`` with zeros for the missing parameters, again in order.

Note [hooks hold their owner weakly]
A hook registered on a parameter (``register_post_accumulate_grad_hook``) is stored by autograd
in C++, where Python's garbage collector cannot follow references. A hook that is a bound method
of its owner would close the cycle parameter -> hook -> owner -> parameter invisibly, and the
owner (a ZeroOptimizer with its masters, optimizer state and gradient buffers) would never be
freed after the user drops the model and the optimizer. So every such hook is built by
:func:`weak_hook`: it holds its owner through a weak reference and does nothing once the owner
is gone. ``close()`` (``ZeroOptimizer.close``) removes the hooks outright.
"""

from __future__ import annotations

import enum
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.zero.config import ZeroConfig
from minispeed.zero.flat import Bucket, FlatLayout

__all__ = ["GradReducer", "ReduceMode", "weak_hook"]

# Stage 2: reduce-scatters awaiting completion before the next one waits for the oldest. Two lets
# one bucket transfer while the next is being filled, bounding the staging memory.
_MAX_IN_FLIGHT = 2


def weak_hook(method: Callable[[nn.Parameter], None]) -> Callable[[nn.Parameter], None]:
    """A parameter hook calling the bound ``method`` while its object is alive, a no-op after.

    See Note [hooks hold their owner weakly]. Costs one weak-reference lookup per call.
    """
    ref = weakref.WeakMethod(method)

    def hook(param: nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(param)

    return hook


class ReduceMode(enum.Enum):
    """When gradients are reduced and where each rank keeps the result."""

    ALL_REDUCE = "all_reduce"  # stage 0: every rank keeps the full averaged gradient
    SCATTER_AT_BOUNDARY = "scatter_at_boundary"  # stage 1: accumulate locally, scatter once
    SCATTER_EVERY_STEP = "scatter_every_step"  # stage 2: scatter every micro-step


@dataclass
class _BucketState:
    """Book-keeping of one bucket during one backward."""

    group: int
    bucket: Bucket
    pending: int = 0  # parameters whose gradient has not arrived yet
    staging: torch.Tensor | None = None  # stage 2: (padded_numel,) grads of this micro-step


@dataclass
class _InFlight:
    work: Any  # comm Work handle, or None once synchronous
    finish: Callable[[], None] | None = None  # runs after the collective completed
    keep: list[torch.Tensor] = field(default_factory=list)  # buffers the collective reads/writes


class GradReducer:
    """Owns the gradient buffers of stages 0-2 and the hooks that fill and reduce them."""

    def __init__(
        self,
        groups: Sequence[Sequence[nn.Parameter]],
        layouts: Sequence[FlatLayout],
        mode: ReduceMode,
        config: ZeroConfig,
        grad_dtype: torch.dtype,
        names: dict[nn.Parameter, str],
        param_position: dict[nn.Parameter, int],
        group: Any = None,
    ) -> None:
        self.mode = mode
        self.config = config
        self.layouts = list(layouts)
        self.comm_group = group
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.names = names
        device = groups[0][0].device if groups and groups[0] else torch.device("cpu")

        # flat_grads[g]: 1-D, numel = layouts[g].numel, grad dtype (stages 0-1).
        # part_grads[g]: 1-D, numel = layouts[g].partition_numel, grad dtype (stage 2).
        # shard_grads[g][b]: this rank's reduced gradient for bucket b (stages 1-2): a view of
        # flat_grads (stage 1, reduced in place) or of part_grads (stage 2).
        full = mode is not ReduceMode.SCATTER_EVERY_STEP
        self.flat_grads = [
            torch.zeros(lay.numel if full else 0, dtype=grad_dtype, device=device)
            for lay in layouts
        ]
        part = mode is ReduceMode.SCATTER_EVERY_STEP
        self.part_grads = [
            torch.zeros(lay.partition_numel if part else 0, dtype=grad_dtype, device=device)
            for lay in layouts
        ]
        self.shard_grads: list[list[torch.Tensor]] = []
        if mode is ReduceMode.SCATTER_AT_BOUNDARY:
            self.shard_grads = [
                [bk.shard_of(flat, self.rank) for bk in lay.buckets]
                for flat, lay in zip(self.flat_grads, layouts)
            ]
        elif part:
            self.shard_grads = [
                [grads[bk.shard_offset : bk.shard_offset + bk.shard_numel] for bk in lay.buckets]
                for grads, lay in zip(self.part_grads, layouts)
            ]
        # Per group, the reduced gradients as fp32, valid at a boundary: the full flat buffer
        # (stage 0) or this rank's shard of each bucket (stages 1-2).
        self._fp32: list[list[torch.Tensor]] | None = None
        # Whether the buffers hold stale values that the next backward overwrites instead of
        # adding to: Note [the first micro-step overwrites].
        self._fresh = True
        # Note [averaging on the way in]: the hook scales each gradient by 1/N as it writes it,
        # when no dtype cast is involved.
        param_dtype = groups[0][0].dtype if groups and groups[0] else grad_dtype
        self._prescaled = param_dtype == grad_dtype and self.world_size > 1
        # The factor each gradient is written with (x·1.0 is exact: a plain copy / add).
        self._write_scale = 1.0 / self.world_size if self._prescaled else 1.0

        # One fixed launch order for every rank: See Note [bucket launch order].
        self._order: list[_BucketState] = []
        for g, lay in enumerate(layouts):
            for bk in lay.buckets:
                self._order.append(_BucketState(g, bk))
        self._order.sort(
            key=lambda s: (
                -max(param_position[groups[s.group][i]] for i in s.bucket.param_indices),
                s.group,
            )
        )
        self._state_of = {(s.group, s.bucket.index): s for s in self._order}
        self._where = {p: (g, i) for g, ps in enumerate(groups) for i, p in enumerate(ps)}
        # Per parameter: (its bucket's state, its slot's view of flat_grads (stages 0-1) or its
        # offset inside the bucket's staging buffer (stage 2)). Built once: the hook's fast path.
        self._target: dict[tuple[int, int], tuple[_BucketState, Any]] = {}
        for g, lay in enumerate(layouts):
            for i, slot in enumerate(lay.slots):
                state = self._state_of[(g, lay.bucket_of_param[i])]
                if full:
                    where: Any = self.flat_grads[g][slot.offset : slot.offset + slot.numel].view(
                        slot.shape
                    )
                else:
                    where = slot.offset - state.bucket.start
                self._target[(g, i)] = (state, where)
        self._seen: set[tuple[int, int]] = set()
        self._next_launch = 0
        self._in_flight: deque[_InFlight] = deque()
        self._micro_step = 0
        self._reset_pending()
        # A frozen parameter (requires_grad=False) never gets a gradient: it counts as unused.
        self._handles = [
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
            for ps in groups
            for p in ps
            if p.requires_grad
        ]

    # -- the hook ---------------------------------------------------------------------------------
    @property
    def reducing_this_backward(self) -> bool:
        """Whether buckets are reduced during the backward now running (else only accumulated)."""
        if self.mode is ReduceMode.SCATTER_EVERY_STEP:
            return True
        return (self._micro_step + 1) % self.config.gradient_accumulation_steps == 0

    def _on_grad(self, p: nn.Parameter) -> None:
        g, i = self._where[p]
        if (g, i) in self._seen:
            raise RuntimeError(
                f"parameter {self.names[p]!r} received a second gradient in one backward (its bucket "
                f"may already be reduced). Call backward once per micro-step through "
                f"ZeroOptimizer.backward(loss) (sum several losses first), and use non-reentrant "
                f"activation checkpointing (use_reentrant=False) for shared parameters"
            )
        self._seen.add((g, i))
        state, where = self._target[(g, i)]
        grad = p.grad.to_dense() if p.grad.is_sparse else p.grad  # nn.Embedding(sparse=True)
        if self.mode is ReduceMode.SCATTER_EVERY_STEP:  # a fresh staging bucket each micro-step
            slot, overwrite = self._staging(state)[where : where + grad.numel()], True
        else:  # Note [the first micro-step overwrites]
            slot, overwrite = where, self._fresh
        # Note [averaging on the way in]: one pass, scaled by 1/N (or 1.0) on the way.
        if overwrite:
            torch.mul(grad, self._write_scale, out=slot.view(grad.shape))
        else:
            slot.add_(grad, alpha=self._write_scale)
        p.grad = None  # the bucket holds it now; free the autograd buffer
        state.pending -= 1
        if self.reducing_this_backward:
            self._launch_ready()

    def _staging(self, state: _BucketState) -> torch.Tensor:
        if state.staging is None:
            grads = self.part_grads[state.group]
            bk = state.bucket
            state.staging = torch.empty(bk.padded_numel, dtype=grads.dtype, device=grads.device)
            state.staging[bk.numel :].zero_()  # padding; missing gradients: _zero_missing
        return state.staging

    def _zero_missing(self, state: _BucketState, buffer: torch.Tensor, base: int) -> None:
        """Zero the slots, in ``buffer`` (whose element 0 is flat element ``base``), of the
        bucket's parameters that got no gradient in this backward."""
        lay = self.layouts[state.group]
        for i in state.bucket.param_indices:
            if (state.group, i) not in self._seen:
                slot = lay.slots[i]
                buffer[slot.offset - base : slot.offset - base + slot.numel].zero_()

    # -- launching and finishing collectives ------------------------------------------------------
    def _launch_ready(self, force: bool = False) -> None:
        """Launch buckets in the fixed order while the next one is complete (or ``force``)."""
        while self._next_launch < len(self._order):
            state = self._order[self._next_launch]
            if state.pending > 0 and not force:
                return
            self._launch(state)
            self._next_launch += 1

    def _launch(self, state: _BucketState) -> None:
        g, bk = state.group, state.bucket
        overlap = self.config.overlap_comm
        mine = slice(
            bk.shard_start(self.rank) - bk.start,
            bk.shard_start(self.rank) - bk.start + bk.shard_numel,
        )
        if self.mode is not ReduceMode.SCATTER_EVERY_STEP:
            if self._fresh:  # Note [the first micro-step overwrites]
                self._zero_missing(state, self.flat_grads[g], 0)
            if self.mode is ReduceMode.ALL_REDUCE:
                view = self.flat_grads[g][bk.start : bk.start + bk.numel]
                work = comm.all_reduce(view, group=self.comm_group, async_op=overlap)
            else:
                # In place: this rank's shard of the bucket receives the reduced shard (Note
                # [in-place flat collectives] in comm/api_compat.py); shard_grads views it.
                bucket = self.flat_grads[g][bk.start : bk.start + bk.padded_numel]
                if self.config.reduce_scatter:
                    work = comm.reduce_scatter_tensor(
                        bucket[mine], bucket, group=self.comm_group, async_op=overlap
                    )
                else:  # the all-reduce leaves the reduced shard in place too
                    work = comm.all_reduce(bucket, group=self.comm_group, async_op=overlap)
            self._track(_InFlight(work))
            return
        # SCATTER_EVERY_STEP: reduce this micro-step's bucket in place, fold this rank's shard
        # into the partition, free the bucket.
        staging = self._staging(state)
        state.staging = None
        self._zero_missing(state, staging, bk.start)
        part = self.shard_grads[g][bk.index]
        fold = part.copy_ if self._fresh else part.add_  # Note [the first micro-step overwrites]
        if len(self._in_flight) >= _MAX_IN_FLIGHT:
            self._finish(self._in_flight.popleft())
        if self.config.reduce_scatter:
            out = staging[mine]
            work = comm.reduce_scatter_tensor(out, staging, group=self.comm_group, async_op=overlap)
        else:
            work = comm.all_reduce(staging, group=self.comm_group, async_op=overlap)
        self._track(_InFlight(work, lambda: fold(staging[mine]), [staging]))

    def _track(self, item: _InFlight) -> None:
        if item.work is None:  # synchronous: already complete
            if item.finish is not None:
                item.finish()
            return
        self._in_flight.append(item)

    @staticmethod
    def _finish(item: _InFlight) -> None:
        item.work.wait()
        if item.finish is not None:
            item.finish()

    def _reset_pending(self) -> None:
        for s in self._order:
            s.pending = len(s.bucket.param_indices)
            s.staging = None
        self._seen.clear()
        self._next_launch = 0

    # -- called by the strategy ---------------------------------------------------------------------
    def backward_done(self, is_boundary: bool) -> None:
        """Launch what is left (missing grads count as zeros), wait for everything, average."""
        expected = (self._micro_step + 1) % self.config.gradient_accumulation_steps == 0
        if is_boundary != expected:
            raise RuntimeError(
                f"micro-step {self._micro_step}: the optimizer says is_boundary={is_boundary} but "
                f"gradient_accumulation_steps={self.config.gradient_accumulation_steps} says {expected}; "
                f"drive every micro-step through ZeroOptimizer.backward(loss)"
            )
        if self.reducing_this_backward:
            self._launch_ready(force=True)
        elif self._fresh:  # nothing reduced: still, missing gradients must read as zeros
            for s in self._order:
                self._zero_missing(s, self.flat_grads[s.group], 0)
        while self._in_flight:
            self._finish(self._in_flight.popleft())
        self._fresh = False
        if is_boundary:
            inv_n = 1.0 / self.world_size
            if self.mode is ReduceMode.ALL_REDUCE:
                reduced = [[t] for t in self.flat_grads]
            else:
                reduced = self.shard_grads
            # Already averaged when prescaled (Note [averaging on the way in]); else average in
            # fp32, since a 16-bit sum divided in 16 bits would round twice. ``float()`` is the
            # tensor itself when it is fp32 already, so that one is averaged in place.
            self._fp32 = [
                [t.float() if self._prescaled else t.float().mul_(inv_n) for t in ts]
                for ts in reduced
            ]
        self._micro_step += 1
        self._reset_pending()

    def reduced(self) -> list[list[torch.Tensor]]:
        """Per group, the averaged fp32 gradient: ``[full flat]`` (stage 0) or this rank's shard of
        every bucket (stages 1-2)."""
        if self._fp32 is None:
            raise RuntimeError(
                "no reduced gradients: call backward on the boundary micro-step first"
            )
        return self._fp32

    def zero_grad(self) -> None:
        """Clear accumulated and reduced gradients (the window starts over).

        Marks the buffers stale rather than filling them with zeros: the next backward overwrites
        them (Note [the first micro-step overwrites]).
        """
        self._fresh = True
        self._fp32 = None

    def remove_hooks(self) -> None:
        """Wait for in-flight collectives, then detach from the model (plain PyTorch again).

        Idempotent. Gradients of a window not yet stepped are dropped with it: nothing more is
        reduced after this.
        """
        while self._in_flight:
            self._finish(self._in_flight.popleft())
        for h in self._handles:
            h.remove()
        self._handles = []
        self._reset_pending()

    @property
    def launched_buckets(self) -> int:
        """Buckets whose collective was issued during the backward now running (0 between)."""
        return self._next_launch

    def bucket_numels(self) -> list[int]:
        """Elements of every bucket's collective, in launch order (padded for stages 1-2)."""
        if self.mode is ReduceMode.ALL_REDUCE:
            return [s.bucket.numel for s in self._order]
        return [s.bucket.padded_numel for s in self._order]
