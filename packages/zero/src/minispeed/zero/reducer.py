"""Gradient hooks -> bucketed collectives while backward still computes: one reducer per schedule.

Every managed parameter gets a `register_post_accumulate_grad_hook`. When autograd has finished a
parameter's gradient, the hook writes it into its bucket's buffer (in `grad_accum_dtype`), frees
`param.grad`, and the bucket's collective is launched once every parameter of the bucket has
arrived (asynchronously with `overlap_comm`), so the communication of the last layers overlaps
the backward of the first ones. The launch order and the window of collectives in flight are
`minispeed.comm.LaunchQueue`'s (Note [bucket launch order]). A model whose gradients fit in one
bucket's elements gets no hook: its gradients are collected once backward ends (Note [a model in
one bucket has no gradient hooks]).

Three schedules, one small class each, sharing `_BucketedGrads` (the hooks, the buffers' first
micro-step, the averaging, the boundary bookkeeping):

| stage | reducer | micro-steps inside a window | the boundary micro-step |
|---|---|---|---|
| 0 | `AllReduceReducer` | accumulate into `flat_grads` | + all-reduce each bucket in place |
| 1 | `BoundaryScatterReducer` | accumulate into `flat_grads` | + reduce-scatter each bucket in place: this rank's shard of it is the result |
| 2 | `BackwardScatterReducer` | reduce-scatter each bucket into `part_grads` (accumulating) | same |

Bytes kept per rank (g = bytes per `grad_accum_dtype` element, Ψ parameters, N ranks):
stages 0 and 1: Ψ·g (full flat gradients; stage 1's reduced partition is this rank's shard of
each bucket, in place); stage 2: Ψ·g/N plus at most `_MAX_IN_FLIGHT` + (buckets being filled)
staging buckets of `ZeroConfig.bucket_numel` elements (`reduce_bucket_numel`, at most 25 MiB).
A model within one bucket (no hooks) also holds its gradients in `param.grad` until backward
ends: Ψ·p more at that peak (p = bytes per parameter element), Ψ ≤ `bucket_numel`. Bytes sent:
see `ledger.py`.

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
dtype cast (gradient dtype = `grad_accum_dtype`) into its bucket, it multiplies by 1/N on the
way (`torch.mul(grad, 1/N, out=slot)`, `slot.add_(grad, alpha=1/N)`): the same single pass as
a plain copy or add. For N a power of two the result is bit-identical to dividing the sum
(scaling by 2^-k is exact and commutes with rounding); otherwise it differs by rounding. With a
cast (16-bit gradients accumulated in fp32) the mean is still taken after the reduction, in fp32.

Note [a 16-bit bucket on the wire]
Under torch.autocast (autocast.py) the gradients of the lower-precision-safe parameters travel in
16 bits at stages 1-2, in buckets of their own (`Bucket.wire_dtype`). The buffers stay in
`grad_accum_dtype` (fp32): at launch the bucket is cast to its wire dtype (already averaged on
the way in, so the cast rounds g/N, as DeepSpeed rounds its bucket before dividing it by N, which
is exact for N a power of two), reduced in it, and this rank's shard is cast back into the fp32
buffer when the collective is done. Bytes sent for that bucket: half of fp32's; held while it is
in flight: one copy of the bucket in the wire dtype (padded_numel · 2 bytes). Stage 3
(`stage3/strategy.py`) has no fp32 bucket buffer: its hook writes each safe gradient into the
bucket's rows in the wire dtype, and the reduced row is cast back to fp32 on delivery.

Note [bucket launch order]
Collectives are matched across ranks by the order they are issued, and gradients may arrive in a
different order on different ranks (data-dependent control flow, or a parameter no rank uses).
So buckets are launched strictly in one fixed order computed identically on every rank (the
order gradients usually arrive in: last layers first); a bucket that completes early waits for
the ones before it. Buckets still incomplete when backward ends (a parameter got no gradient)
are launched by `backward_done` with zeros for the missing parameters, again in order.

Note [a model in one bucket has no gradient hooks]
When all the managed gradients together fit in one bucket's elements (`ZeroConfig.bucket_numel`,
summed over the param groups' layouts; the rule is `core.gradient_buckets.hooks_each_gradient`,
which the profiler's step-time model prices the hooks by), there is no communication to overlap
with backward: the hooks would launch the bucket(s) at the last gradient anyway, just before
backward ends. So no hook is registered. Autograd leaves each gradient in `param.grad` as plain
PyTorch does, and `backward_done` collects them (`_collect`): a parameter whose `.grad` is set got
a gradient in this backward (the used mark), the gradients are written into their slots in two
foreach dispatches (copy then ×1/N on a window's first micro-step, `add_(alpha=1/N)` after: the
products and sums of the hook's `torch.mul` / `add_`, bit for bit) and `param.grad` is freed, then
the buckets launch in order as before. Per gradient that is a loop iteration instead of a hook call
from autograd's C++ and five Python calls with one dispatch each: at 30K parameters (29 gradients,
a micro-step of ~3.5 ms of CPU) the engine's ZeRO-0 step went from 1.13× PyTorch DDP's CPU time to
1.03× (medians of nine alternating runs; DDP's reducer is C++: docs/benchmarks.md). The cost: the
gradients stay in `param.grad` until backward
ends, at most one bucket's elements in the parameters' dtype more at the peak (DDP keeps a full
second copy too), and a parameter used twice in one backward (reentrant checkpointing) has its two
gradients summed by autograd, as in plain PyTorch, where the hooks refuse it. A gradient already
in `param.grad` when `backward_begins` runs came from a backward outside `ZeroOptimizer.backward`
and is refused (one `.grad` read per parameter per micro-step). Larger models keep the
per-gradient hooks and their overlap.

Note [the reducer marks the used parameters]
The optimizer must know which parameters got a gradient on any rank in the window (Note [unused
parameters] in optimizer.py). Every gradient passes through the reducer, in a hook or in
`_collect`, which marks it in `_seen`; each backward folds those marks into the window's
(`_window_used`), and the optimizer takes them at its step (`take_window_marks`, through
`BucketedStrategy.used_marks`) instead of hooking every parameter itself. So a model within one
bucket has no hook on its gradients at all, at stages 0-2 alike, and a larger one one hook per
gradient, the reducer's (before, stages 1-2 and stage 0 with loss scaling added the optimizer's
marker: one more Python call per gradient, which the profiler's step-time model did not price).
Cost: one OR of m bytes per backward (m parameters).

Note [the flags ride with the last bucket]
At every optimizer step the ranks must agree on which parameters got a gradient on any rank
(Note [unused parameters] in optimizer.py). Stage 0 needs no other verdict when no loss is scaled:
every rank holds the same all-reduced gradient, so nothing else can differ between ranks. So
`AllReduceReducer.carry_flags` lays out one fp32 element per managed parameter (m in all)
beside the flat gradient buffer of the last bucket launched, at whichever end of the buffer that
bucket touches, and the bucket's all-reduce (a sum) carries them: 1 where this rank used the
parameter in the window (a hooked one) or where a parameter frozen at `shard()` requires grad
now; after the sum, > 0 means "on some rank". That is one collective and one host round trip
fewer per step (about 4 % of a 30K-parameter model's step on 2 gloo ranks: docs/benchmarks.md)
for m·4 more bytes in the bucket. The bucket is launched only once every parameter's hook ran
(the queue launches in order) or at the end of backward, so the window's marks are complete
then. Flags and gradients share no element: the gradients' views, averaging and optimizer never
see the flags. fp32 gradient buffers only (a 16-bit sum counts exactly only to 256 or 2,048).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.comm.buckets import InFlight, LaunchQueue
from minispeed.core import ranges
from minispeed.core.gradient_buckets import hooks_each_gradient
from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import weak_hook
from minispeed.zero.flat import Bucket, FlatLayout

__all__ = [
    "AllReduceReducer",
    "BackwardScatterReducer",
    "BoundaryScatterReducer",
    "weak_hook",
]

# Stage 2: reduce-scatters in flight before the oldest is waited for. Two let one bucket transfer
# while the next is being filled, bounding the staging memory.
_MAX_IN_FLIGHT = 2


class _BucketedGrads:
    """What the three schedules share: the hooks, the launch order, the first micro-step of a
    window, the averaging, and the boundary's fp32 results.

    A schedule says where a gradient is written (`_slot`), whether this backward reduces
    (`_reducing_now`), how one bucket is reduced (`_launch`), and which tensors hold the reduced
    result (`_results`).
    """

    max_in_flight: int | None = None  # collectives waiting at once (None: no bound)

    def __init__(
        self,
        groups: Sequence[Sequence[nn.Parameter]],
        layouts: Sequence[FlatLayout],
        config: ZeroConfig,
        grad_dtype: torch.dtype,
        names: dict[nn.Parameter, str],
        param_position: dict[nn.Parameter, int],
        group: Any = None,
        grad_divisor: int | None = None,
    ) -> None:
        self.config = config
        self.layouts = list(layouts)
        self.comm_group = group
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        # The reduced sum is divided by this: the group's size, or the data-parallel size where
        # the group is a replica group (Note [replica groups] in replica_groups.py).
        self.grad_divisor = grad_divisor if grad_divisor is not None else self.world_size
        self.names = names
        self.grad_dtype = grad_dtype
        self.device = groups[0][0].device if groups and groups[0] else torch.device("cpu")
        # Per group, the reduced gradients as fp32, valid at a boundary (`reduced()`).
        self._fp32: list[list[torch.Tensor]] | None = None
        # Whether the buffers hold stale values that the next backward overwrites instead of
        # adding to: Note [the first micro-step overwrites].
        self._fresh = True
        # Note [averaging on the way in]: the hook scales each gradient by 1/N as it writes it,
        # when no dtype cast is involved (x·1.0 is exact: a plain copy / add).
        param_dtype = groups[0][0].dtype if groups and groups[0] else grad_dtype
        self._prescaled = param_dtype == grad_dtype and self.grad_divisor > 1
        self._write_scale = 1.0 / self.grad_divisor if self._prescaled else 1.0

        # One fixed launch order for every rank: See Note [bucket launch order].
        order = [(g, bk) for g, lay in enumerate(layouts) for bk in lay.buckets]
        order.sort(
            key=lambda gb: (
                -max(param_position[groups[gb[0]][i]] for i in gb[1].param_indices),
                gb[0],
            )
        )
        self._order: list[tuple[int, Bucket]] = order
        launch_index = {(g, bk.index): k for k, (g, bk) in enumerate(order)}
        # The queue calls back through a weak reference: a strong one would be a reference cycle,
        # and the buffers would outlive `del opt` until a garbage collection.
        launch = weakref.WeakMethod(self._launch_index)
        self._queue = LaunchQueue(
            [len(bk.param_indices) for _, bk in order],
            lambda k: launch()(k),
            self.max_in_flight,
        )
        # _seen[g][i] = 1: parameter i of group g got its gradient in this backward.
        self._seen = [bytearray(len(ps)) for ps in groups]
        # The window's marks so far, the groups' parameters in order (`take_window_marks`,
        # Note [the reducer marks the used parameters]).
        self._window_used = bytearray(sum(len(ps) for ps in groups))
        self._micro_step = 0
        # Whether the backward now running ends the accumulation window, as the optimizer said
        # (`backward_begins`); None: not said, counted from `gradient_accumulation_steps`.
        self._ends_window: bool | None = None
        # `_reducing_now()` for the backward now running, decided once per backward (it changes
        # only in `backward_begins` and `backward_done`), not once per gradient.
        self._launching = self._reducing_now()
        # A frozen parameter (requires_grad=False) never gets a gradient: it counts as unused.
        # Each one is bound to (group, index in group, launch index of its bucket): no lookup
        # keyed by the parameter on the gradient's path.
        managed = [
            (p, g, i, launch_index[(g, layouts[g].bucket_of_param[i])])
            for g, ps in enumerate(groups)
            for i, p in enumerate(ps)
            if p.requires_grad
        ]
        # See Note [a model in one bucket has no gradient hooks].
        numel = sum(lay.numel for lay in layouts)
        one_bucket = not hooks_each_gradient(numel, config.bucket_numel(grad_dtype.itemsize))
        self._collected = managed if one_bucket else []
        self._handles = [
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad, g, i, k))
            for p, g, i, k in managed
            if not one_bucket
        ]

    # -- what a schedule defines -------------------------------------------------------------
    def _slot(self, g: int, i: int, k: int) -> tuple[torch.Tensor, bool]:
        """(where parameter i of group g writes its gradient, shaped as the parameter; whether it
        overwrites)."""
        raise NotImplementedError

    def _reducing_now(self) -> bool:
        """Whether buckets are reduced during the backward now running (else only accumulated)."""
        raise NotImplementedError

    def _launch(self, g: int, bk: Bucket, k: int) -> InFlight:
        """Issue the collective of bucket `bk` of group `g` (launch index `k`)."""
        raise NotImplementedError

    def _results(self) -> list[list[torch.Tensor]]:
        """Per group, the tensors holding the reduced gradients after the boundary."""
        raise NotImplementedError

    # -- the hook ----------------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter, g: int, i: int, k: int) -> None:
        seen = self._seen[g]
        if seen[i]:
            raise RuntimeError(
                f"parameter {self.names[p]!r} received a second gradient in one backward (its bucket "
                f"may already be reduced). Call backward once per micro-step through "
                f"ZeroOptimizer.backward(loss) (sum several losses first), and use non-reentrant "
                f"activation checkpointing (use_reentrant=False) for shared parameters"
            )
        seen[i] = 1
        grad = p.grad
        if grad.is_sparse:  # nn.Embedding(sparse=True)
            grad = grad.to_dense()
        slot, overwrite = self._slot(g, i, k)  # shaped as the parameter
        # Note [averaging on the way in]: one pass, scaled by 1/N (or 1.0) on the way.
        if overwrite:
            torch.mul(grad, self._write_scale, out=slot)
        else:
            slot.add_(grad, alpha=self._write_scale)
        p.grad = None  # the bucket holds it now; free the autograd buffer
        self._queue.arrived(k, launch=self._launching)

    def _collect(self) -> None:
        """Write every gradient autograd left in `param.grad` into its slot, in two dispatches
        (Note [a model in one bucket has no gradient hooks])."""
        fresh: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        added: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for p, g, i, k in self._collected:
            grad = p.grad
            if grad is None:  # not used in this backward (or frozen since)
                continue
            p.grad = None  # the bucket holds it now
            self._seen[g][i] = 1
            if grad.is_sparse:  # nn.Embedding(sparse=True)
                grad = grad.to_dense()
            slot, overwrite = self._slot(g, i, k)
            slots, grads = fresh if overwrite else added
            slots.append(slot)
            grads.append(grad)
        # The products and sums of `_on_grad`'s torch.mul / add_, bit for bit (Note [averaging
        # on the way in]): a copy then x·s is torch.mul(x, s, out=slot); add_ is add_.
        if fresh[0]:
            torch._foreach_copy_(fresh[0], fresh[1])
            if self._write_scale != 1.0:
                torch._foreach_mul_(fresh[0], self._write_scale)
        if added[0]:
            torch._foreach_add_(added[0], added[1], alpha=self._write_scale)

    def _launch_index(self, k: int) -> InFlight:
        g, bk = self._order[k]
        return self._launch(g, bk, k)

    def _zero_missing(self, g: int, bk: Bucket, buffer: torch.Tensor, base: int) -> None:
        """Zero the slots, in `buffer` (whose element 0 is flat element `base`), of the bucket's
        parameters that got no gradient in this backward."""
        lay, seen = self.layouts[g], self._seen[g]
        for i in bk.param_indices:
            if not seen[i]:
                slot = lay.slots[i]
                buffer[slot.offset - base : slot.offset - base + slot.numel].zero_()

    def _shard_range(self, bk: Bucket) -> slice:
        """This rank's shard of bucket `bk`, relative to the bucket's first element."""
        lo = bk.shard_start(self.rank) - bk.start
        return slice(lo, lo + bk.shard_numel)

    def _scatter(
        self, bk: Bucket, full: torch.Tensor, then: Any = None, keep: tuple = ()
    ) -> InFlight:
        """Reduce-scatter the bucket `full` (padded) so that this rank's shard of it holds the
        sum (with `reduce_scatter` off: all-reduce it whole), then run `then`. In the bucket's
        `wire_dtype` when it has one: Note [a 16-bit bucket on the wire]."""
        overlap, group = self.config.overlap_comm, self.comm_group
        mine = full[self._shard_range(bk)]
        wire = full if bk.wire_dtype in (None, full.dtype) else full.to(bk.wire_dtype)
        if self.config.reduce_scatter:
            work = comm.reduce_scatter_tensor(
                wire[self._shard_range(bk)], wire, group=group, async_op=overlap
            )
        else:
            work = comm.all_reduce(wire, group=group, async_op=overlap)
        if wire is full:
            return InFlight(work, then, keep)

        def finish() -> None:
            mine.copy_(wire[self._shard_range(bk)])
            if then is not None:
                then()

        return InFlight(work, finish, (*keep, wire))

    # -- called by the strategy -------------------------------------------------------------
    def _window_ends(self) -> bool:
        """Whether the backward now running ends the accumulation window."""
        if self._ends_window is not None:
            return self._ends_window
        return (self._micro_step + 1) % self.config.gradient_accumulation_steps == 0

    def backward_begins(self, is_boundary: bool) -> None:
        """The optimizer says whether the coming backward ends the window."""
        for p, _, _, _ in self._collected:  # Note [a model in one bucket has no gradient hooks]
            if p.grad is not None:
                raise RuntimeError(
                    f"parameter {self.names[p]!r} holds a gradient before ZeroOptimizer.backward: "
                    f"a backward ran outside it (a plain loss.backward()), whose gradients would "
                    f"be added to this micro-step's. Drive every micro-step through "
                    f"ZeroOptimizer.backward(loss), and leave param.grad to it"
                )
        self._ends_window = is_boundary
        self._launching = self._reducing_now()

    @ranges.range("zero.grads.finish")
    def backward_done(self, is_boundary: bool) -> None:
        """Launch what is left (missing grads count as zeros), wait for everything, average."""
        expected = self._window_ends()
        if is_boundary != expected:
            raise RuntimeError(
                f"micro-step {self._micro_step}: the optimizer says is_boundary={is_boundary} but "
                f"the hooks were told {expected}; drive every micro-step through "
                f"ZeroOptimizer.backward(loss)"
            )
        if self._collected:
            self._collect()
        if self._reducing_now():
            self._queue.flush()
        elif self._fresh:  # nothing reduced: still, missing gradients must read as zeros
            for g, bk in self._order:
                self._zero_missing(g, bk, self.flat_grads[g], 0)
        self._fresh = False
        if is_boundary:
            inv_n = 1.0 / self.grad_divisor
            # Already averaged when prescaled (Note [averaging on the way in]); else average in
            # fp32, since a 16-bit sum divided in 16 bits would round twice. `float()` is the
            # tensor itself when it is fp32 already, so that one is averaged in place.
            self._fp32 = [
                [t.float() if self._prescaled else t.float().mul_(inv_n) for t in ts]
                for ts in self._results()
            ]
        self._micro_step += 1
        self._ends_window = None
        self._window_done(is_boundary)
        self._reset()

    def _window_done(self, is_boundary: bool) -> None:
        """After each backward, before `_seen` is cleared: fold its marks into the window's."""
        self._window_used = self._marks()

    def _marks(self) -> bytearray:
        """The window's used marks so far, this backward's included (flat parameter order)."""
        w = self._window_used
        now = b"".join(self._seen)
        return bytearray(
            (int.from_bytes(w, "little") | int.from_bytes(now, "little")).to_bytes(len(w), "little")
        )

    def take_window_marks(self) -> bytearray:
        """1 per parameter of the groups (in order) that got a gradient on this rank since the
        last call, and start over (Note [the reducer marks the used parameters])."""
        marks, self._window_used = self._window_used, bytearray(len(self._window_used))
        return marks

    def _reset(self) -> None:
        self._queue.reset()
        for seen in self._seen:
            seen[:] = bytes(len(seen))
        self._launching = self._reducing_now()  # for a backward not begun by the optimizer

    def reduced(self) -> list[list[torch.Tensor]]:
        """Per group, the averaged fp32 gradient: `[full flat]` (stage 0) or this rank's shard
        of every bucket (stages 1-2)."""
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

    def held_buffers(self) -> list[torch.Tensor]:
        """The gradient buffers this reducer keeps between steps (what `parking.park` calls
        `lp_grads`): every group's reduced gradients, views of its flat or partition buffer."""
        return [t for ts in self._results() for t in ts]

    def staging_buffers(self) -> list[torch.Tensor]:
        """The buckets' staging buffers alive now (`parking.park`'s `contiguous_grad_buffer`):
        none here; stage 2's while a bucket's reduce-scatter is outstanding."""
        return []

    def remove_hooks(self) -> None:
        """Wait for in-flight collectives, then detach from the model (plain PyTorch again).

        Idempotent. Gradients of a window not yet stepped are dropped with it: nothing more is
        reduced after this.
        """
        self._queue.wait_all()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._collected = []
        self._reset()

    @property
    def launched_buckets(self) -> int:
        """Buckets whose collective was issued during the backward now running (0 between)."""
        return self._queue.next

    def bucket_numels(self) -> list[int]:
        """Elements of every bucket's collective, in launch order (padded for stages 1-2)."""
        return [bk.padded_numel for _, bk in self._order]


class _FlatBufferGrads(_BucketedGrads):
    """Stages 0 and 1: every micro-step accumulates into one full flat buffer per group."""

    def __init__(self, groups, layouts, *args: Any, **kwargs: Any) -> None:
        super().__init__(groups, layouts, *args, **kwargs)
        # flat_grads[g]: 1-D, numel = layouts[g].numel, grad dtype.
        self.flat_grads = [
            torch.zeros(lay.numel, dtype=self.grad_dtype, device=self.device) for lay in layouts
        ]
        # Per parameter, its slot's view of flat_grads. Built once: the hook's fast path.
        self._views = {
            (g, i): self.flat_grads[g][s.offset : s.offset + s.numel].view(s.shape)
            for g, lay in enumerate(layouts)
            for i, s in enumerate(lay.slots)
        }

    def _slot(self, g: int, i: int, k: int) -> tuple[torch.Tensor, bool]:
        return self._views[(g, i)], self._fresh  # Note [the first micro-step overwrites]

    def _reducing_now(self) -> bool:
        return self._window_ends()


class AllReduceReducer(_FlatBufferGrads):
    """Stage 0: accumulate locally; at the boundary all-reduce each bucket of the flat buffer in
    place, so every rank holds the full averaged gradient. Sends 2(N-1)/N·Ψ·g per step, plus
    2(N-1)/N·4m with the optimizer's flags in the last bucket (`carry_flags`)."""

    # Set by carry_flags: (group of the last bucket, its all-reduced tensor with the flags,
    # the flags, frozen (flat index, parameter)s); the window's marks; whether they travelled.
    _carry: tuple[int, torch.Tensor, torch.Tensor, list[tuple[int, nn.Parameter]]] | None = None
    _carried = False

    def carry_flags(self, groups: Sequence[Sequence[nn.Parameter]]) -> bool:
        """Carry the optimizer's used / unfrozen flags, one fp32 element per parameter of
        `groups` (in order), in the last bucket's all-reduce (Note [the flags ride with the
        last bucket]); whether it can (fp32 buffers, that bucket at an end of its buffer). The
        same answer on every rank: it depends on the layout and dtype only."""
        if not self._order or self.grad_dtype != torch.float32:
            return False
        g, bk = self._order[-1]
        n, m = self.layouts[g].numel, sum(len(ps) for ps in groups)
        if bk.start != 0 and bk.start + bk.numel != n:
            return False
        whole = torch.zeros(n + m, dtype=torch.float32, device=self.device)
        head = bk.start == 0  # the flags before the buffer, else after it
        flat = whole[m:] if head else whole[:n]
        flat.copy_(self.flat_grads[g])
        self.flat_grads[g] = flat
        for i, s in enumerate(self.layouts[g].slots):
            self._views[(g, i)] = flat[s.offset : s.offset + s.numel].view(s.shape)
        bucket = whole[: m + bk.numel] if head else whole[bk.start :]
        flags = whole[:m] if head else whole[n:]
        ps = [p for group in groups for p in group]
        frozen = [(j, p) for j, p in enumerate(ps) if not p.requires_grad]
        self._carry = (g, bucket, flags, frozen)
        return True

    def carried_flags(self) -> torch.Tensor | None:
        """The summed flags of the window that just ended, if they travelled with its last
        bucket (else None: the optimizer agrees on its own). Read once per boundary."""
        if not self._carried:
            return None
        self._carried = False
        return self._carry[2]  # type: ignore[index]

    def _window_done(self, is_boundary: bool) -> None:
        if self._carry is not None and is_boundary:  # the marks travelled with the last bucket
            self._window_used = bytearray(len(self._window_used))
        else:
            super()._window_done(is_boundary)

    def _launch(self, g: int, bk: Bucket, k: int) -> InFlight:
        if self._fresh:  # Note [the first micro-step overwrites]
            self._zero_missing(g, bk, self.flat_grads[g], 0)
        view = self.flat_grads[g][bk.start : bk.start + bk.numel]
        if self._carry is not None and k == len(self._order) - 1:
            # Note [the flags ride with the last bucket]
            _, view, flags, frozen = self._carry
            marks = self._marks()
            for j, p in frozen:
                marks[j] = p.requires_grad  # unfrozen since shard(): every rank raises
            flags.copy_(torch.frombuffer(marks, dtype=torch.uint8))
            self._carried = True
        return InFlight(
            comm.all_reduce(view, group=self.comm_group, async_op=self.config.overlap_comm)
        )

    def _results(self) -> list[list[torch.Tensor]]:
        return [[t] for t in self.flat_grads]

    def bucket_numels(self) -> list[int]:
        """Elements of every bucket's all-reduce, in launch order (unpadded; the last one with
        the flags when it carries them)."""
        numels = [bk.numel for _, bk in self._order]
        if self._carry is not None:
            numels[-1] = self._carry[1].numel()
        return numels


class BoundaryScatterReducer(_FlatBufferGrads):
    """Stage 1: accumulate locally; at the boundary reduce-scatter each bucket in place: this
    rank's shard of the flat buffer receives its reduced shard. Sends (N-1)/N·Ψ'·g per step."""

    def __init__(self, groups, layouts, *args: Any, **kwargs: Any) -> None:
        super().__init__(groups, layouts, *args, **kwargs)
        # shard_grads[g][b]: this rank's reduced gradient for bucket b, a view of flat_grads.
        self.shard_grads = [
            [bk.shard_of(flat, self.rank) for bk in lay.buckets]
            for flat, lay in zip(self.flat_grads, layouts)
        ]

    def _launch(self, g: int, bk: Bucket, k: int) -> InFlight:
        if self._fresh:  # Note [the first micro-step overwrites]
            self._zero_missing(g, bk, self.flat_grads[g], 0)
        # In place: this rank's shard of the bucket receives the reduced shard (Note [in-place
        # flat collectives] in comm/api_compat.py); shard_grads views it.
        # (the all-reduce, with reduce_scatter off, leaves the reduced shard in place too)
        return self._scatter(bk, self.flat_grads[g][bk.start : bk.start + bk.padded_numel])

    def _results(self) -> list[list[torch.Tensor]]:
        return self.shard_grads


class BackwardScatterReducer(_BucketedGrads):
    """Stage 2: every micro-step, reduce-scatter each bucket as soon as it is complete and fold
    this rank's shard into its gradient partition; the full gradient never exists at once.
    Sends (N-1)/N·Ψ'·g per micro-step."""

    max_in_flight = _MAX_IN_FLIGHT

    def __init__(self, groups, layouts, *args: Any, **kwargs: Any) -> None:
        super().__init__(groups, layouts, *args, **kwargs)
        # part_grads[g]: 1-D, numel = layouts[g].partition_numel, grad dtype.
        self.part_grads = [
            torch.zeros(lay.partition_numel, dtype=self.grad_dtype, device=self.device)
            for lay in layouts
        ]
        # shard_grads[g][b]: this rank's reduced gradient for bucket b, a view of part_grads.
        self.shard_grads = [
            [grads[bk.shard_offset : bk.shard_offset + bk.shard_numel] for bk in lay.buckets]
            for grads, lay in zip(self.part_grads, layouts)
        ]
        # staging[k]: (padded_numel,) gradients of this micro-step for the bucket launched k-th,
        # from its first gradient until its reduce-scatter is finished.
        self._staging: dict[int, torch.Tensor] = {}

    def _bucket_staging(self, g: int, bk: Bucket, k: int) -> torch.Tensor:
        staging = self._staging.get(k)
        if staging is None:
            staging = torch.empty(bk.padded_numel, dtype=self.grad_dtype, device=self.device)
            staging[bk.numel :].zero_()  # padding; missing gradients: _zero_missing
            self._staging[k] = staging
        return staging

    def _slot(self, g: int, i: int, k: int) -> tuple[torch.Tensor, bool]:
        bk = self._order[k][1]
        slot = self.layouts[g].slots[i]
        lo = slot.offset - bk.start
        staging = self._staging.get(k)  # the bucket's first gradient makes it
        if staging is None:
            staging = self._bucket_staging(g, bk, k)
        return staging[lo : lo + slot.numel].view(slot.shape), True  # fresh every micro-step

    def _reducing_now(self) -> bool:
        return True

    def _launch(self, g: int, bk: Bucket, k: int) -> InFlight:
        staging = self._bucket_staging(g, bk, k)
        del self._staging[k]
        self._zero_missing(g, bk, staging, bk.start)
        part = self.shard_grads[g][bk.index]
        fold = part.copy_ if self._fresh else part.add_  # Note [the first micro-step overwrites]
        mine = self._shard_range(bk)
        return self._scatter(bk, staging, lambda: fold(staging[mine]), (staging,))

    def _results(self) -> list[list[torch.Tensor]]:
        return self.shard_grads

    def _reset(self) -> None:
        super()._reset()
        self._staging.clear()

    def staging_buffers(self) -> list[torch.Tensor]:
        return list(self._staging.values())
