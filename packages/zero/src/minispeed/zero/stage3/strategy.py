"""Stage3Strategy: ZeRO stage 3 as the optimizer sees it, and its gradient reduce-scatter.

``zero.shard(model, optimizer, ZeroConfig(stage=3))`` builds one with `assemble`
(stage3/assemble.py: partitions, masters, persistent parameters, fetch units, hooks, ZeRO++,
this reducer, in that order). What runs at every step is here: the optimizer's view of the
shards (`master_params`, `master_grads`, `publish_params`) and `GradShardReducer`.

Per rank (Ψ parameters, N ranks, p/g bytes per parameter/gradient element, K = 8 for Adam's
state): ``Ψ/N·(p + 4 + g + K)`` kept (padding: < 1 element per parameter per rank; ``4`` is the
master, absent for fp32 where master and shard are one tensor; ``g`` is held from backward to the
step only: Note [lazy gradient shards]), plus persistent parameters whole
(``Ψ_pers·p``) and what is gathered at the moment (bounded by the largest unit plus the prefetch
window, at most one 4M-element chunk: Note [a prefetch stays one chunk ahead] in prefetch.py;
within ``stage3_max_live_numel``). Bytes sent per micro-step: see ledger.py.

**Gradients.** A parameter's full gradient exists only briefly: autograd accumulates it into
``param.grad`` (full shape, parameter dtype) while the parameter is gathered for backward; a
``register_post_accumulate_grad_hook`` then moves it into a bucket and drops ``param.grad``.
When the bucket is complete (``ZeroConfig.bucket_numel``: ``reduce_bucket_numel``, at most
25 MiB) it is reduce-scattered (async with ``overlap_comm``, so it travels while backward
computes the layers below); rank r receives row r, its shard of every gradient in the bucket,
divided by N. The reduce-scatter input must be rank-major (row r is what rank r receives):

```text
gradient of a (n=7, N=2, s=4):   a0 a1 a2 a3 | a4 a5 a6 0      -> rows of a: (2, 4)
gradient of b (n=4, s=2):        b0 b1 | b2 b3                 -> rows of b: (2, 2)
bucket = cat(rows, dim=1):       row 0: a0 a1 a2 a3 b0 b1      (2, 6) -> rank 0 gets row 0
                                 row 1: a4 a5 a6 0  b2 b3                 rank 1 gets row 1
```

Costs of the gradients: ``Σ s·g`` bytes kept from the first reduction of a window to the step,
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
from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import ParamFragment, ShardStrategy, weak_hook
from minispeed.zero.flat import cut_runs
from minispeed.zero.precision import MixedPrecision
from minispeed.zero.stage3.access import unguard_module
from minispeed.zero.stage3.coordinator import FetchCoordinator
from minispeed.zero.stage3.params import (
    REGISTRY,
    FetchUnit,
    ParamState,
    ShardedParam,
    refresh_gathered,
)
from minispeed.zero.stage3.released import unguard_param
from minispeed.zero.stage3.residency import ShardHome

__all__ = ["GradShardReducer", "Stage3Strategy"]

# Note [optional features are chosen once]
# ZeRO++ and offload_param change how a parameter is gathered and where its released shard
# lives, on the hottest path of stage 3 (every fetch and release of every module). Instead of
# asking "is ZeRO++ on? is this shard offloaded?" there, each ShardedParam is given, once at
# setup, the objects that do it: its `gatherer` (params.PLAIN_GATHER, or the strategy's ZeroPP)
# and its `home` (residency.STAYS_HERE, or offload's home for it). The gather path calls them
# unconditionally; a feature that is off costs one no-op call. ZeRO-Infinity's optimizer side
# (masters and gradients in files) is a strategy of its own wrapping this one (infinity.py).


class Stage3Strategy(ShardStrategy):
    """Parameters, gradients and optimizer state partitioned; parameters fetched per module.

    Built by `assemble` (stage3/assemble.py: the set-up, in order), which hands it the parts.
    """

    partitions_grads = True  # each rank holds 1/N of the gradients: the norm needs an all-reduce

    def __init__(
        self,
        model: nn.Module,
        config: ZeroConfig,
        precision: MixedPrecision,
        group: Any,
        *,
        data_group: Any,
        groups: list[list[nn.Parameter]],
        sharded: dict[nn.Parameter, ShardedParam],
        persistent: list[ShardedParam],
        units: dict[nn.Module, FetchUnit],
        coordinator: FetchCoordinator,
        module_hooks: list[Any],
        zeropp: Any,
        reducer: GradShardReducer,
    ) -> None:
        self.model, self.config, self.precision, self.group = model, config, precision, group
        # Every rank holding these shards: `group`, or under MiCS its replicas too (mics.py).
        # The I/O agreements run over it: a shard group raising alone would leave its
        # replicas waiting in the next all-reduce across.
        self.data_group = data_group
        self.groups = groups  # the optimizer's param groups
        self.sharded = sharded  # every parameter's ShardedParam, in named_parameters() order
        self.trained = [sharded[p] for ps in groups for p in ps]
        self.persistent = persistent
        self.units, self.coordinator, self._handles = units, coordinator, module_hooks
        # ZeroPP or None; GradShardReducer; 1 or N (Note [averaging at the loss])
        self.zeropp, self.reducer, self.loss_divisor = zeropp, reducer, reducer.loss_divisor
        # offload_param (stage3/offloaded.py, through `offload_params`): where released shards
        # live, the parameters that live there, and its record of failed file I/O.
        self.param_home: ShardHome | None = None
        self.offloaded: list[ShardedParam] = []
        self.io_failures: Any = None

    # -- ShardStrategy ------------------------------------------------------------------------------
    def master_params(self) -> list[list[torch.Tensor]]:
        """Per group, one fp32 shard per parameter (``ceil(n/N)`` elements, zero padding)."""
        return [[self.sharded[p].master for p in ps] for ps in self.groups]

    def master_grads(self) -> list[list[torch.Tensor]]:
        """Per group, the fp32 gradient shards, averaged over ranks (valid after backward_done)."""
        return [[self.reducer.grad_of(self.sharded[p]) for p in ps] for ps in self.groups]

    def backward_begins(self, is_boundary: bool) -> None:
        """Nothing to decide: stage 3 reduce-scatters every micro-step's gradients."""

    def backward_done(self, is_boundary: bool) -> None:
        """Wait for the gradient reduce-scatters; make sure nothing gathered for backward remains."""
        self.reducer.flush()
        self.coordinator.end_backward()

    @torch.no_grad()
    def publish_params(self) -> None:
        """Write the stepped masters into the 16-bit shards; re-gather persistent parameters.

        Non-persistent parameters are released now and pick up the new shards at their next
        fetch. Sends one all-gather of ``Σ_persistent N·s·p`` bytes. With offload_param each
        new shard is written to its home (``s·p`` bytes); with nvme the step ends in the I/O
        agreement (one 1-element all-reduce, `IOFailures.agree`).
        """
        for sp in self.trained:
            if sp.master is not sp.shard:
                sp.home.write(sp, sp.master)
        refresh_gathered([sp for sp in self.trained if sp.state is ParamState.GATHERED])
        if self.io_failures is not None:
            self.io_failures.agree(self.data_group, "the end of the optimizer step")

    def zero_grad(self) -> None:
        """Drop the gradient shards (and any ``param.grad`` left by hand-written backward code)."""
        self.reducer.zero_grad()
        for p in self.sharded:
            p.grad = None

    def fragments(self) -> list[ParamFragment]:
        """Per trained parameter, the slice ``[r·s, r·s + owned)`` this rank holds (padding excluded)."""
        return [
            ParamFragment(sp.name, sp.shape, sp.start, sp.owned_numel, g, i, 0)
            for g, ps in enumerate(self.groups)
            for i, sp in enumerate([self.sharded[p] for p in ps])
        ]

    # -- extras -------------------------------------------------------------------------------------
    def offload_params(self, home: Any, offloaded: list[ShardedParam], io_failures: Any) -> None:
        """offload_param, chosen once at ``zero.shard`` (stage3/offloaded.py): ``offloaded``
        live in ``home`` (closed by `close`); ``io_failures`` (None without file I/O) is agreed
        on at the end of each step and of `close`."""
        self.param_home, self.offloaded, self.io_failures = home, offloaded, io_failures

    def sharded_params(self) -> list[ShardedParam]:
        """Every ShardedParam of the model, in ``named_parameters()`` order."""
        return list(self.sharded.values())

    def close(self) -> None:
        """Gather every parameter back into the model and remove all stage-3 hooks and guards.

        Afterwards the model is a plain nn.Module with full parameters (``Ψ·p`` bytes per rank)
        and this strategy must not be used. Collective: one all-gather of all released parameters;
        with offload_param nvme, a shard that could not be read makes every rank raise (one
        1-element all-reduce), and the shard files are deleted either way.
        """
        try:
            self._close()
            if self.io_failures is not None:
                self.io_failures.agree(self.data_group, "close(), gathering the model back")
        finally:
            if self.param_home is not None:
                self.param_home.close()

    def _close(self) -> None:
        self.reducer.wait_in_flight()
        self.coordinator.end_backward()
        FetchUnit(-1, "close", "", list(self.sharded.values())).unshard()
        for sp in self.sharded.values():
            sp.to_plain()
            unguard_param(sp.param)
            sp.coordinator = None
            REGISTRY.pop(sp.param, None)
        self.reducer.remove()
        if self.zeropp is not None:
            self.zeropp.remove()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self.model.modules():
            unguard_module(module)


# -- gradients -------------------------------------------------------------------------------------
# Note [a fixed bucket plan]
# Collectives are matched across ranks by the order they are issued, so every rank must cut its
# gradients into the same buckets and launch them in the same order, even when a parameter gets a
# gradient on one rank and not on another (``if rank == 0: h = h * self.extra``). Buckets are
# therefore planned once, identically on every rank, from the parameters' registration order
# reversed (the order backward usually produces them); a bucket is launched when all of its
# parameters have arrived and every bucket before it is launched, and the buckets still incomplete
# when backward ends are launched then, a missing gradient counting as zeros. (Bucketing by arrival
# order, as this reducer first did, sent reduce-scatters of different sizes in that case and gloo
# aborted the process.) A parameter no rank used gets a zero gradient shard; the optimizer still
# skips it (Note [unused parameters] in optimizer.py).

# Note [lazy gradient shards]
# The first micro-step of a window makes each gradient shard a view of the bucket's received row
# (no copy, no zero-filled buffer waiting through forward); later micro-steps add into it.
# ``zero_grad`` drops the shards, as
# ``optimizer.zero_grad(set_to_none=True)`` does, so between the step and the next backward, and
# through the whole forward, a rank holds no gradient bytes at all. The shards (``Σ s·g`` bytes) are needed from the reduction of a
# parameter's gradient until the optimizer step. Allocating them once and zeroing them after each
# step (as this reducer first did) keeps them through the forward and the start of backward, which
# is exactly when activations peak: on the benchmark's GPT that was 6 MiB of a 70 MiB peak per rank
# that FSDP2 does not pay (it also creates sharded gradients during backward). Now they appear
# bucket by bucket as backward proceeds, while activations are being freed.

# Note [a large gradient travels alone]
# A bucket of several gradients is reduce-scattered from one (N, cols) buffer, so each gradient
# is copied into it (``torch.cat``), a new buffer every backward: Ψ·g bytes written per step (on
# CPU also a page fault per 4 KiB when the allocator hands out fresh pages). A gradient of at
# least ``_ALONE_NUMEL`` elements forms a bucket of its own instead, reduced in place in the very
# tensor autograd produced (its ``(N, s)`` view; a copy only when padding or a cast is needed).
# Cost: one collective per large gradient instead of a share of one (comm adds 30-45 µs of CPU to
# torch's own call on gloo), against a copy of ``g·n`` bytes, 1 MiB and up: at 33.9M parameters
# 34 reduce-scatters per step instead of 6, 135 MB fewer copied, 24-25 ms of CPU a step (about
# 1%; docs/benchmarks.md, "Stage 3: large gradients alone"). Still at most
# ``reduce_bucket_numel`` elements per message.
_ALONE_NUMEL = 1 << 18

# Note [averaging at the loss]
# The reduce-scatter sums N ranks' gradients; the optimizer wants their mean. Dividing the reduced
# row afterwards is a pass over every gradient shard (Ψ/N elements a step: 16 ms of a 2.3 s step
# at 33.9M on 2 gloo ranks, the main thread's CPU in ``mul``). When N is a power of two the
# reducer asks the optimizer to divide the loss by N instead (``loss_divisor``; one scalar
# multiply): backward then produces every gradient already divided by N, exactly, since scaling
# by 2^-k commutes with rounding through the linear maps backward is made of (results differ
# only where a value would fall below fp32's normal range, ~1e-38). comm's reduce-scatter writes
# the summed row into a compact (cols,) tensor given to it (out of place: comm's ring on 2 gloo
# ranks then receives straight into it, with no scratch), and that tensor is the gradient shards:
# no pass at all. fp16 parameters keep the division after the reduction (a gradient N times
# smaller may underflow in fp16), and so do other N and ZeRO++'s or MiCS's collectives (which
# reduce, quantize or divide on their own), in place in the compact row.

# Reduce-scatters in flight before the next launch waits for the oldest: bounds staging memory.
_MAX_IN_FLIGHT = 2


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
        wire_dtypes: dict[nn.Parameter, torch.dtype] | None = None,
    ) -> None:
        """`wire_dtypes[param]`: the dtype that parameter's gradient is reduce-scattered in
        (torch.autocast's safe parameters: minispeed/zero/autocast.py), in buckets of their own;
        the others travel in `grad_dtype`. The caller leaves it out with ZeRO++ or MiCS."""
        self.group = group
        self.world_size = n = comm.get_world_size(group)
        self.rank = comm.get_rank(group)
        self.grad_dtype = grad_dtype
        self.overlap = overlap
        # comm.reduce_scatter_tensor, or ZeRO++'s quantized two-hop one (stage3/zeropp_grads.py)
        self.reduce_scatter = reduce_scatter or comm.reduce_scatter_tensor
        # Note [averaging at the loss]: the optimizer divides the loss by this before backward.
        exact = n & (n - 1) == 0 and torch.float16 not in {sp.shard.dtype for sp in sps}
        self.loss_divisor = n if exact and reduce_scatter is None else 1
        # Where each reduced shard goes, sink(sp, averaged_shard): `_keep` here, or ZeRO-Infinity's
        # (stage3/infinity.py), to a swap file. Chosen once, at zero.shard (`redirect`).
        self._sink: Any = self._keep
        # This rank's gradient shard of each parameter, from the first reduction of a window to
        # `zero_grad` (Note [lazy gradient shards]); written only by `_keep` and `grad_of`.
        self._grads: dict[ShardedParam, torch.Tensor] = {}
        # A frozen parameter never gets a gradient and is never reduced.
        sps = [sp for sp in sps if sp.param.requires_grad]
        self._by_param: dict[nn.Parameter, ShardedParam] = {sp.param: sp for sp in sps}
        # Note [a fixed bucket plan]: registration order reversed, cut at bucket_numel elements.
        rank_of = position or {sp: k for k, sp in enumerate(sps)}
        backwards = sorted(sps, key=lambda sp: -rank_of[sp])
        sizes = [self.world_size * sp.shard_numel for sp in backwards]  # reduce-scatter input
        # A large gradient forms a bucket of its own: Note [a large gradient travels alone].
        sizes = [max(n, bucket_numel) if n >= _ALONE_NUMEL else n for n in sizes]
        # The dtype each gradient travels in: Note [a 16-bit bucket on the wire] (reducer.py).
        self._dtypes = {sp: (wire_dtypes or {}).get(sp.param, grad_dtype) for sp in sps}
        kinds = [self._dtypes[sp] for sp in backwards]  # a bucket travels in one dtype
        self._plan: list[list[ShardedParam]] = cut_runs(backwards, sizes, bucket_numel, kinds)
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
        rows = sp.grad_by_rank(grad, self._dtypes[sp])
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
        rows = []
        for sp in self._plan[b]:
            got = arrived.pop(sp, None)
            if got is None:  # no gradient on this rank: zeros (Note [a fixed bucket plan])
                got = sp.shard.new_zeros(self.world_size, sp.shard_numel, dtype=self._dtypes[sp])
            rows.append(got)
        staged = torch.cat(rows, dim=1) if len(rows) > 1 else rows[0].contiguous()  # (N, cols)
        del rows  # the full gradients are freed now (unless staged is one of them, uncopied)
        # comm's ring or a native reduce-scatter writes this rank's reduced row into a compact
        # (cols,) tensor of its own (the ring on 2 ranks needs no scratch then), which becomes the
        # gradient shards: no copy out (Note [averaging at the loss]). gloo's all-reduce forms
        # (`comm.reduce_scatter_as`) write it in place, into this rank's row of the input (Note
        # [in-place flat collectives], comm/api_compat.py), copied out in `_deliver`.
        compact = comm.reduce_scatter_impl(self.group) in ("native", "ring_p2p")
        row = staged.new_empty(staged.shape[1]) if compact else staged[self.rank]
        with ranges.range("zero3.reduce_scatter"):
            work = self.reduce_scatter(row, staged.ravel(), group=self.group, async_op=self.overlap)
        return InFlight(work, lambda: self._deliver(row, compact, b), (staged, row))

    def _deliver(self, row: torch.Tensor, compact: bool, b: int) -> None:
        """The reduction of bucket ``b`` completed: ``row`` (cols) holds this rank's summed row.

        Divided by N here unless the loss was (Note [averaging at the loss]); the gradient shards
        are views of a compact (cols,) tensor: ``row``, or its copy when it is a row of the input.
        """
        # (not compact: a copy, to free the input; a 16-bit bucket: back in the gradients' dtype)
        if self.loss_divisor == 1 or not compact or row.dtype != self.grad_dtype:
            row = row.to(self.grad_dtype).mul(self.loss_divisor / self.world_size)
        for sp, mine in zip(self._plan[b], row.split([sp.shard_numel for sp in self._plan[b]])):
            self._sink(sp, mine)

    def _keep(self, sp: ShardedParam, mine: torch.Tensor) -> None:
        """The default sink: keep this rank's averaged shard (a view at the window's first
        micro-step: Note [lazy gradient shards]; added to it after)."""
        held = self._grads.get(sp)
        if held is None:
            self._grads[sp] = mine
        else:
            held.add_(mine)

    def redirect(self, sink: Any) -> None:
        """Send each reduced shard to ``sink(sp, shard)`` instead of keeping it (ZeRO-Infinity's
        gradient files, set up once), or (``None``, at close) keep them again."""
        assert (sink is None) == (self._sink != self._keep), f"redirect to {sink} over {self._sink}"
        self._sink = self._keep if sink is None else sink

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
        self._grads.clear()

    def grad_of(self, sp: ShardedParam) -> torch.Tensor:
        """``sp``'s averaged gradient shard; zeros (allocated now) if it received none."""
        held = self._grads.get(sp)
        if held is None:
            held = self._grads[sp] = sp.shard.new_zeros(sp.shard_numel, dtype=self.grad_dtype)
        return held

    def grad_shard(self, sp: ShardedParam) -> torch.Tensor | None:
        """``sp``'s gradient shard held now, or None (none reduced in this window yet, or sent
        to a file); nothing is allocated."""
        return self._grads.get(sp)

    def remove(self) -> None:
        """Remove the gradient hooks (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
