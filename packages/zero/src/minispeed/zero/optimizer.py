"""The partitioned optimizer: the user's torch.optim optimizer, stepping fp32 master tensors.

Read `contract.py` first: `ShardStrategy` (what a ZeRO stage does with parameters and gradients)
and `ParamFragment` (which piece of which parameter a rank's masters hold) live there, and are
re-exported here. Then:

- `ZeroOptimizer`: backward with loss scaling, then at each accumulation boundary
  overflow check, clipping, the inner step on masters, and publishing masters to the model.

Bytes kept by the optimizer itself per rank: the inner optimizer's state for this rank's masters
(K bytes per master element: 8 for Adam(W), 4 for SGD with momentum, 0 for plain SGD) and one
fp32 vector of num_params + 1 elements for the cross-rank agreement (num_params + 2 with swap
files under stage 3: Note [an I/O failure fails every rank] in stage3/io_failures.py). The
masters and gradient buffers belong to the strategy (see its module for their bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

import minispeed.comm as comm
from minispeed.core import ranges
from minispeed.core.logging import get_logger
from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import ParamFragment, ShardStrategy, param_names
from minispeed.zero.flat import cut_runs
from minispeed.zero.lifetime import Detachable
from minispeed.zero.model_parallel import ModelParallel
from minispeed.zero.precision import LossScaler, MixedPrecision

__all__ = ["ParamFragment", "ShardStrategy", "ZeroOptimizer", "param_names"]


# Note [unused parameters]
# torch.optim skips a parameter whose `.grad` is None: no weight decay, no momentum decay, no
# state step. A plain training loop leaves `.grad` None for a parameter the forward never
# touched (TinyGPT's `unused`), so to match it we must know which parameters received a
# gradient on *any* rank during the accumulation window. Every rank sets a flag per parameter in
# a post-accumulate-grad hook, and the flags are all-reduced (MAX) once per optimizer step, in the
# same tiny call that agrees on fp16 overflow: (num_params + 1) fp32 elements (PyTorch DDP does
# the same with `find_unused_parameters`). At stage 0 with no loss scaling they need no call of
# their own: they are summed in the last gradient bucket's all-reduce (Note [the flags ride with
# the last bucket] in reducer.py; `flags_in_bucket`). The reductions themselves treat a missing gradient
# as zeros (the buckets must be reduced on every rank either way). Every strategy gives each
# parameter fragment a master tensor of its own (stage12.py: Note [one master per fragment]), so
# for a parameter no rank used the master's `.grad` is set to None and the inner optimizer
# skips it exactly as torch would, including its per-parameter `step` count (Adam's bias
# correction). `ZeroConfig(ignore_unused_parameters=False)` turns such a parameter into an
# error instead. A parameter frozen after `shard()` (`requires_grad=False`) gets no gradient
# either and is skipped the same way, as in PyTorch, without that error.

# Note [requires_grad is fixed at shard time]
# The gradient hooks and buffers are built by `shard()` for the parameters that required grad
# then. A parameter frozen at that time and set `requires_grad=True` later would get a
# `.grad` that no hook reduces, and silently never train. So every step compares each
# parameter's flag with the one seen at `shard()`; a parameter unfrozen on any rank is agreed
# on in the same all-reduce, in the overflow slot (0: clean, 1: overflow, 2 + k: parameter k was
# unfrozen; the MAX wins), and every rank raises naming it, before the optimizer touches anything.

# Note [optimizer sub-groups]
# The inner step allocates temporaries: torch's multi-tensor ("foreach") Adam, the default for
# CUDA tensors, computes e.g. `sqrt(exp_avg_sq)` for *every* tensor it steps before combining
# them, so one step of S master elements briefly holds a few times S·4 more bytes. DeepSpeed's
# `sub_group_size` bounds that: the masters are cut, in order, into runs of at most
# `ZeroConfig.sub_group_numel` elements (a fragment larger than that is a run of its own), and
# the inner optimizer is called once per run, with `.grad` set only on that run's masters
# (torch.optim skips the others). Peak temporaries then scale with max(sub_group_numel, largest
# fragment) instead of Ψ/N. Same results: every update is elementwise. Costs: one
# `optimizer.step()` call per run (optimizer step hooks fire once per run). The for-loop
# implementation (the CPU default) already bounds temporaries by the largest tensor.


# Note [ZeroOptimizer is a torch.optim.Optimizer]
# torch's LR schedulers accept only instances of torch.optim.Optimizer and then use three things
# of it: `param_groups` (each group's `lr`, OneCycleLR also `betas`/`momentum`), `defaults`
# (OneCycleLR checks for momentum there) and `step` (wrapped, to warn when the scheduler steps
# first). DeepSpeed's ZeRO optimizer exposes `param_groups` the same way. So ZeroOptimizer
# subclasses Optimizer *without* running its __init__: `param_groups`, `defaults` and `state` are
# the inner optimizer's (whose groups are the user's own dicts, with or without offload: Note
# [the user's param groups are the host optimizer's] in offload_bridge.py), and every inherited
# method that would read attributes torch's __init__ sets is overridden here (state_dict,
# load_state_dict, zero_grad, add_param_group, the hook registrations).


# Note [a scheduler on the user's optimizer sees it step]
# A torch LR scheduler wraps its optimizer's `step` to set `optimizer._opt_called`, and warns
# ("lr_scheduler.step() before optimizer.step()") at its first step when the flag is missing.
# Under offload the user's optimizer is never stepped itself (offload's CPU optimizer steps its
# param groups), so every correct loop would get that warning: each real step sets the flag on
# the user's optimizer, exactly as torch's wrapper would have.


class ZeroOptimizer(torch.optim.Optimizer, Detachable):
    """The user's optimizer, stepping this rank's fp32 masters, driven with DeepSpeed semantics.

    Built by `minispeed.zero.shard`. Call `backward` and `step` on every
    micro-step; the optimizer acts only on the last micro-step of each accumulation window:

    ```python
    loss = model(x, y)
    opt.backward(loss)   # scales the loss (fp16 scale / gradient_accumulation_steps)
    opt.step()           # True when an optimizer step was taken
    ```

    What one `step` does at a boundary: unscale (fp16), agree on overflow and unused
    parameters across ranks (one all-reduce of num_params + 1 fp32 elements; at stage 0 with no
    loss scaling none: the flags were summed with the last gradient bucket), skip the step on
    overflow (lowering the scale; no weight touched), clip by the global norm (sum of squares over
    this rank's disjoint gradient shards, one fp32 all-reduce when gradients are partitioned),
    run the inner optimizer, publish masters into the model parameters, clear the gradients.
    With `model_parallel` (`zero.ModelParallel`: the grid's other axes), the shared gradients
    are summed first, the verdict is agreed and the norm summed over those axes too.

    A `torch.optim.Optimizer` for LR schedulers (Note [ZeroOptimizer is a torch.optim.Optimizer]):
    `param_groups` are the user's optimizer's groups, read at every step with or without
    offload, so `torch.optim.lr_scheduler.OneCycleLR(opt, ...)` on this object or on the
    optimizer passed to `zero.shard` changes the rates actually used. `state_dict` /
    `load_state_dict` save and restore this rank's part (see `minispeed.zero.rank_state`).

    Attributes: `optimizer` (the inner optimizer, now holding master tensors: the user's, or
    offload's CPU optimizer over the user's param groups), `strategy`, `config`, `precision`, `loss_scaler`,
    `global_step` (optimizer steps taken, skipped ones excluded), `micro_step` (backward calls),
    `overflow` (whether the last window's step was skipped for inf/NaN gradients: DeepSpeed's
    optimizers' attribute, which accelerate's `optimizer_step_was_skipped` reads),
    `flags_in_bucket` (whether the step's flags travel in the last gradient bucket: the ledger's
    `stage_collectives(..., flags_in_bucket=...)`).

    A window ends after `gradient_accumulation_steps` backward calls, or where the caller says
    (`backward(loss, ends=...)`: DeepSpeed's `set_gradient_accumulation_boundary`, which
    accelerate uses to end the last window of an epoch early); every micro-batch's loss is
    divided by `gradient_accumulation_steps` either way, as DeepSpeed divides it.

    Lifetime: dropping the model and this optimizer (`del opt, model`) frees everything (the
    hooks hold it weakly: Note [hooks hold their owner weakly] in contract.py). `close`
    hands the model back as a plain `nn.Module` while keeping it; `with zero.shard(...) as opt:`
    calls it on leaving the block.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        strategy: ShardStrategy,
        config: ZeroConfig,
        precision: MixedPrecision,
        params: Sequence[nn.Parameter],
        names: dict[nn.Parameter, str],
        group: Any = None,
        *,
        on_close: Callable[[], None] | None = None,
        user_optimizer: torch.optim.Optimizer | None = None,
        model_parallel: ModelParallel | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.strategy = strategy
        self.config = config
        self.precision = precision
        self.comm_group = group
        self.loss_scaler = LossScaler(precision, config.stage)
        self.global_step = 0
        self.micro_step = 0
        self._grad_norm: Tensor | None = None  # before clipping, at the last clipped step
        self.overflow = False  # the last boundary skipped its step (inf/NaN gradients)
        # Backward calls in the current accumulation window; whether the last one ended it
        # (and step() has not handled it yet).
        self._window, self._window_ended = 0, False

        masters = strategy.master_params()  # `optimizer` steps them (api.py: _step_masters)

        # See Note [unused parameters]. Slot 0 carries this rank's fp16 overflow flag, or an
        # unfrozen parameter (Note [requires_grad is fixed at shard time]).
        self._params = list(params)
        self._names = names
        # ZeRO-Infinity (files): the last slot says "file I/O failed on this rank since the
        # last step" (Note [an I/O failure fails every rank] in stage3/io_failures.py).
        self._io = strategy.io_failures
        # On the backend's device (NCCL: the GPU), even where offload keeps masters on the host.
        self._agreement = torch.zeros(
            len(self._params) + 1 + (self._io is not None),
            dtype=torch.float32,
            device=comm.tensor_device(self.comm_group),
        )
        # Where the master gradients live: the overflow flag and the norm are summed there.
        self._grad_device = _device_of(masters)
        self._trainable_at_shard = [p.requires_grad for p in self._params]
        self._backward_since_step = False
        # _used[k] = 1: parameter k got a gradient on this rank in this window. Bytes written by
        # a hook holding only this buffer (no owner, so no cycle: Note [hooks hold their owner
        # weakly] in contract.py): one Python call per gradient, no lookup keyed by the
        # parameter (a tensor's `__hash__` is a Python call); a tensor write per gradient would
        # cost a dispatcher round trip each. Copied into `_agreement` once, in step().
        self._used = bytearray(len(self._params))
        self._closed = False
        self._on_close = on_close  # zero.shard: lets the model be sharded again
        # Offload steps a CPU optimizer over the user's groups: see Note [a scheduler on the
        # user's optimizer sees it step].
        self._user_optimizer = user_optimizer if user_optimizer is not optimizer else None
        self._fragments = strategy.fragments()
        keys = [(f.group, f.master_index) for f in self._fragments]
        if len(set(keys)) != len(keys) or any(f.master_offset for f in self._fragments):
            raise RuntimeError(
                f"{type(strategy).__name__} shares master tensors between fragments; "
                f"ZeroOptimizer needs one master per fragment, starting at offset 0 (padding may "
                f"follow it): Note [one master per fragment] in stage12.py"
            )
        self._skip_key = {f.name: (f.group, f.master_index) for f in self._fragments}
        # See Note [optimizer sub-groups]: runs of (group, index) of at most sub_group_numel.
        # Offload's swapped optimizers cut their own partitions and pipeline the reads across
        # them (Note [the swap pipeline] in offload/swapped.py): one run, one call, for all.
        order = [(g, i) for g, ms in enumerate(masters) for i in range(len(ms))]
        sizes = [masters[g][i].numel() for g, i in order]
        own_runs = getattr(optimizer, "partitions", None) is not None
        self._sub_groups = [order] if own_runs else cut_runs(order, sizes, config.sub_group_numel)
        # The grid's other axes: norm, verdict and shared gradients (model_parallel.py).
        self.model_parallel = model_parallel
        self._uncounted = (
            set() if model_parallel is None else model_parallel.uncounted_indices(params)
        )
        self._fragment_of = {f.name: f for f in self._fragments}
        # The flags in the last gradient bucket, not an all-reduce of their own (stage 0 with no
        # loss scaling and no other grid axis: Note [the flags ride with the last bucket] in
        # reducer.py). Every rank decides alike (from the config and the layout).
        carry = getattr(strategy, "carry_flags", None)
        self.flags_in_bucket = bool(model_parallel is None and carry and carry(self._params))
        # Carried flags are marked by the reducer's own hooks, and a strategy that sees every
        # gradient marks them itself (Note [the reducer marks the used parameters]): no hook.
        self._marked_by_strategy = strategy.marks_used(self._params)
        self._hooks = [
            p.register_post_accumulate_grad_hook(_used_marker(self._used, k))
            for k, p in enumerate(self._params)
            if p.requires_grad and not self.flags_in_bucket and not self._marked_by_strategy
        ]

    # -- torch.optim.Optimizer's surface (Note [ZeroOptimizer is a torch.optim.Optimizer]) ----
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's param groups: the user's dicts ("params" are this rank's masters).
        Hyper-parameters written here (by a scheduler) apply from the next step."""
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's defaults (the user's hyper-parameters)."""
        return self.optimizer.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's per-master state (swapped optimizers: what is in memory)."""
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state: inner state and hyper-parameters, fp32 masters, loss
        scale and counters (host copies: Ψ/N·(4 + K) bytes). Local; `load_state_dict` restores
        it on the same rank of the same layout. To change world size or stage use
        `zero.save_checkpoint` / `zero.load_checkpoint`."""
        from minispeed.zero.rank_state import rank_state_dict

        return rank_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any], *, masters_only: bool = False) -> None:
        """Restore what `state_dict` returned on this rank (collective: every rank calls it, the
        masters are then published into the model as after a step). `masters_only`: the fp32
        masters alone; the inner optimizer's state, the loss scale and the counters stay as
        they are (a checkpoint loaded without its optimizer states)."""
        from minispeed.zero.rank_state import load_rank_state_dict

        self._check_open("load_state_dict")
        load_rank_state_dict(self, state_dict, masters_only=masters_only)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the partition of every parameter is fixed by `zero.shard`."""
        raise RuntimeError(
            "ZeroOptimizer.add_param_group: the param groups are partitioned at zero.shard and "
            "cannot grow; put every parameter in the optimizer before zero.shard (frozen ones too)"
        )

    def _no_hooks(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "ZeroOptimizer does not run torch.optim hooks; register them on opt.optimizer (the "
            "inner optimizer, called once per sub-group at each boundary step)"
        )

    register_step_pre_hook = register_step_post_hook = _no_hooks  # type: ignore[assignment]
    register_state_dict_pre_hook = register_state_dict_post_hook = _no_hooks  # type: ignore[assignment]
    register_load_state_dict_pre_hook = _no_hooks  # type: ignore[assignment]
    register_load_state_dict_post_hook = _no_hooks  # type: ignore[assignment]

    # -- micro-step -------------------------------------------------------------------------------
    @property
    def at_boundary(self) -> bool:
        """Whether the last backward completed an accumulation window (`step` will act)."""
        return self._window_ended

    @property
    def window_micro_steps(self) -> int:
        """Backward calls since the last boundary step (0 between windows)."""
        return self._window

    def backward(self, loss: Tensor, *, ends: bool | None = None, divided: bool = False) -> None:
        """Backward of `loss` scaled by `loss_scale / gradient_accumulation_steps` (and divided by
        the strategy's `loss_divisor`, N where its reduction then yields the mean).

        `ends`: whether this micro-step ends the accumulation window (`None`: when it is the
        window's `gradient_accumulation_steps`-th). `divided=True`: the caller divided the loss
        already (the Trainer normalizes by the window's tokens), so it is scaled by
        `loss_scale` only (DeepSpeed's `scale_wrt_gas=False`)."""
        self._check_open("backward")
        if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(
                "ZeroOptimizer.backward expects the scalar loss of this micro-batch (a 1-element "
                "tensor that requires grad); reduce it with .mean() or .sum() first"
            )
        if self.at_boundary:
            raise RuntimeError(
                f"backward() after the boundary micro-step {self.micro_step} without step(): the "
                f"reduced gradients of that window would leak into the next one; call opt.step() "
                f"after every backward (it acts only at accumulation boundaries)"
            )
        gas = self.config.gradient_accumulation_steps
        is_boundary = self._window + 1 == gas if ends is None else bool(ends)
        # loss_divisor: 1, or N where the strategy's sum is then the mean (Note [averaging at the
        # loss] in stage3/strategy.py); a power of two, so the order of the divisions is exact.
        factor = self.loss_scaler.scale / self.strategy.loss_divisor / (1 if divided else gas)
        self.strategy.backward_begins(is_boundary)
        with ranges.range("zero.backward"):
            # In fp32, so that an fp16 loss times 2**16 does not overflow before backward starts.
            (loss.float() * factor if factor != 1.0 else loss).backward()
            # The end-of-backward reduction (the boundary's all-reduce or reduce-scatter; at
            # stages 2-3 the last buckets' flush): wall_clock_breakdown's backward_allreduce.
            with ranges.range("zero.backward_done"):
                self.strategy.backward_done(is_boundary)
        self.micro_step += 1
        self._window, self._window_ended = self._window + 1, is_boundary
        self._backward_since_step = True

    # -- step -------------------------------------------------------------------------------------
    def step(self, closure: None = None) -> bool:  # type: ignore[override]
        """Take the optimizer step if a window just ended; returns whether weights changed.

        Call it after every `backward` (it acts only at accumulation boundaries). A call
        with no `backward` since the previous one is an error: there is nothing to step.
        `closure` (torch.optim's signature) must be None.
        """
        self._check_open("step")
        if closure is not None:
            raise ValueError(
                "ZeroOptimizer.step takes no closure: run forward and opt.backward(loss) first"
            )
        if not self._backward_since_step:
            raise RuntimeError(
                f"step() with no backward() since the last step() (micro-step {self.micro_step}): "
                f"call opt.backward(loss) on each micro-batch before opt.step(); a plain "
                f"loss.backward() bypasses the ZeroOptimizer (no loss scaling, no accumulation "
                f"window), so its gradients are never stepped"
            )
        self._backward_since_step = False
        if not self.at_boundary:
            return False
        with ranges.range("zero.step"):
            return self._boundary_step()

    def _boundary_step(self) -> bool:
        self._window, self._window_ended, self.overflow = 0, False, False
        grads_by_group = self.strategy.master_grads()
        grads = [g for gs in grads_by_group for g in gs]
        if self.model_parallel is not None and self.model_parallel.shared:
            self.model_parallel.sum_shared(
                self._fragment_of,
                self._names,
                grads_by_group,
                self.comm_group,
                self.strategy.partitions_grads,
            )

        # A flag where checked (ZeRO-Infinity's gradients in files: by the strategy's Σ g²)
        overflow = self.loss_scaler.unscale(grads, self._grad_device, self.strategy)
        if self.flags_in_bucket:  # summed with the gradients: no collective of their own
            flags = self.strategy.carried_flags(self._trainable_at_shard)
        else:
            flags = self._agree(overflow)
        overflow = flags[0] == 1 or (self.flags_in_bucket and bool(overflow))  # stage 0: whole

        if self.model_parallel is not None:  # the verdict over the whole grid: model_parallel.py
            failed = flags[0] >= 2 or (self._io is not None and bool(flags[-1]))
            try:
                overflow = self.model_parallel.agree_step(overflow, failed, self._agreement.device)
            except RuntimeError:
                self.strategy.zero_grad()
                raise
        if self._io is not None and flags[-1]:  # nothing is stepped with a failed read's zeros
            self.strategy.zero_grad()
            self._io.raise_everywhere(
                self.comm_group, f"step {self.global_step + 1}'s agreement, before any update"
            )
        if flags[0] >= 2:
            self.strategy.zero_grad()
            name = self._names[self._params[int(flags[0]) - 2]]
            raise RuntimeError(
                f"parameter {name!r} was frozen (requires_grad=False) when zero.shard() ran and "
                f"requires grad now; its gradient has no hook or buffer, so it would never be "
                f"trained. Set requires_grad before zero.shard(), or re-shard: save with "
                f"zero.save_checkpoint, opt.close(), zero.shard(model, new_optimizer, ...), "
                f"zero.load_checkpoint"
            )
        unused = [p for p, f in zip(self._params, flags[1 : 1 + len(self._params)]) if f == 0]

        if overflow:
            # Skip: no master, no state and no parameter is touched. See LossScaler. The norm
            # of overflowed gradients is infinite, as DeepSpeed's optimizers report it.
            self.overflow, self._grad_norm = True, torch.full((), math.inf)
            self.strategy.zero_grad()
            self.loss_scaler.skip(self.global_step + self.loss_scaler.overflows + 1)  # logs it
            return False
        missing = [p for p in unused if p.requires_grad]  # a frozen one is skipped silently
        if missing and not self.config.ignore_unused_parameters:
            raise RuntimeError(
                f"parameters {[self._names[p] for p in missing]} got no gradient on any rank this "
                f"step; remove them from the optimizer, or set "
                f"ZeroConfig(ignore_unused_parameters=True)"
            )
        if self.config.max_grad_norm > 0:
            self._clip(grads)

        skip = {self._skip_key[self._names[p]] for p in unused}
        if self._io is None:
            self._inner_step(self.strategy.master_params(), grads_by_group, skip)
        else:  # a failure is recorded; publish_params ends in the agreement that raises it
            self._io.run(
                "the optimizer step (reading, stepping and writing the swapped partitions)",
                lambda: self._inner_step(self.strategy.master_params(), grads_by_group, skip),
            )
        self.strategy.publish_params()
        self.loss_scaler.update(overflow=False)
        # Note [a scheduler on the user's optimizer sees it step]
        if self._user_optimizer is not None:
            self._user_optimizer._opt_called = True  # type: ignore[attr-defined]
        self.strategy.zero_grad()
        self.global_step += 1
        return True

    def _agree(self, overflow: Tensor | None) -> list[float]:
        """The step's flags agreed in one all-reduce (MAX) of their own: [overflow or 2 + the
        last unfrozen parameter, then 1.0 per parameter used on some rank] (+ I/O failure)."""
        if overflow is not None:
            self._agreement[:1].copy_(overflow)
        unfrozen = [
            k
            for k, (p, was) in enumerate(zip(self._params, self._trainable_at_shard))
            if p.requires_grad and not was
        ]
        if unfrozen:  # See Note [requires_grad is fixed at shard time]
            self._agreement[0] = float(unfrozen[-1] + 2)
        marks = self.strategy.used_marks() if self._marked_by_strategy else self._used
        used = torch.tensor(marks, dtype=torch.uint8)  # slots 1..n: 1.0 where used
        self._agreement[1 : 1 + len(self._used)].copy_(used)
        self._used[:] = bytes(len(self._used))
        if self._io is not None:  # writes still in flight must land (or fail) before the vote
            self._io.settle()
            self._agreement[-1] = float(self._io.failed)
        comm.all_reduce(self._agreement, op=comm.ReduceOp.MAX, group=self.comm_group)
        flags = self._agreement.tolist()  # the one host sync of the step
        self._agreement.zero_()
        return flags

    def _inner_step(
        self,
        masters: list[list[Tensor]],
        grads: list[list[Tensor]],
        skip: set[tuple[int, int]],
    ) -> None:
        """Run the inner optimizer once per sub-group (Note [optimizer sub-groups]); a master in
        `skip` keeps `.grad = None`, so torch.optim leaves it and its state untouched."""
        for run in self._sub_groups:
            for g, i in run:
                if (g, i) not in skip:
                    masters[g][i].grad = grads[g][i]
            try:
                self.optimizer.step()
            finally:
                for g, i in run:
                    masters[g][i].grad = None

    def _clip(self, grads: list[Tensor]) -> None:
        """Scale gradients so that their global L2 norm is at most `max_grad_norm` (`inf`: only
        compute the norm)."""
        sq = torch.zeros(1, dtype=torch.float32, device=self._grad_device)
        # The strategy's own sum where it knows better: ZeRO-Infinity's gradients are in swap
        # files (the sum was kept as they were written); replica groups weigh their squares so
        # that the sum over ranks counts every parameter once (Note [replica groups]).
        own = self.strategy.grad_square_sum()
        if own is not None:
            sq += own.to(sq.device)
        counted = [  # a copy counted on another model-parallel rank is left out
            g if g.dtype == torch.float32 else g.float()
            for k, g in enumerate(grads if own is None else ())
            if k not in self._uncounted
        ]
        for run in cut_runs(counted, [g.numel() for g in counted], _SQUARES_NUMEL):
            # One dispatch squares a run (the products of g.pow(2), bit for bit); the sums
            # and their order are the per-tensor loop's, so the norm keeps its last bits.
            for s in torch._foreach_mul(run, run):
                sq += s.sum()
        if self.strategy.partitions_grads:  # disjoint shards: the squares add up across ranks
            travel = sq.to(comm.tensor_device(self.comm_group))  # the host under offload + NCCL
            comm.all_reduce(travel, group=self.comm_group)
            sq = travel.to(self._grad_device)
        if self.model_parallel is not None:  # the other axes' parts of the model
            sq = self.model_parallel.sum_squares(sq)
        self._grad_norm = sq.sqrt().nan_to_num(math.inf, math.inf)  # NaN as inf; no host sync
        if self.config.max_grad_norm == math.inf:  # the norm only: nothing to scale
            return
        # torch.nn.utils.clip_grad_norm_'s rule, so that results match it.
        coef = torch.clamp(self.config.max_grad_norm / (sq.sqrt() + 1e-6), max=1.0)
        if self.strategy.scale_grads(float(coef)):  # applied as they are read back (Infinity)
            return
        if grads:  # one call for all: the products of g.mul_ on each
            torch._foreach_mul_(grads, [coef.to(g.dtype) for g in grads])

    def shared_params(self) -> list[nn.Parameter]:
        """The parameters whose gradient this optimizer sums over model-parallel ranks at each
        step (`ModelParallel.shared`; a pipeline executor leaves their tie sum to it)."""
        return [] if self.model_parallel is None else [s.param for s in self.model_parallel.shared]

    @property
    def global_grad_norm(self) -> float | None:
        """The global L2 norm of the gradients before clipping, at the last step that clipped
        (`max_grad_norm` > 0, `math.inf` for the norm without clipping); infinite after a step
        skipped for inf/NaN gradients (and where a NaN was not checked: DeepSpeed's
        `inf`); `None` before the first step or with `max_grad_norm` 0
        (until an overflow)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every accumulated gradient (`step` already does this after stepping).
        `set_to_none` is accepted for torch.optim's signature (gradients are always dropped).

        Refused in the middle of an accumulation window, where it would silently discard the
        micro-batches accumulated so far (the plain-PyTorch habit of calling `zero_grad()`
        before every backward).
        """
        if self._window != 0:
            raise RuntimeError(
                f"zero_grad() after micro-step {self._window} of "
                f"{self.config.gradient_accumulation_steps} would discard the gradients "
                f"accumulated in this window; call it only after step() (which already clears "
                f"them), or drop the call"
            )
        self.strategy.zero_grad()

    def fragments(self) -> list[ParamFragment]:
        """Which pieces of which parameters this rank's masters hold (for checkpoints)."""
        return self._fragments

    def fragment_of(self, param: nn.Parameter) -> ParamFragment | None:
        """This rank's fragment of model parameter `param` (`numel` 0 where it holds none of
        it), or None for a parameter this optimizer does not step (frozen, or not its model's)."""
        name = self._names.get(param)
        return None if name is None else self._fragment_of.get(name)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Detach from the model: it stays a plain, usable `nn.Module`; this optimizer is done.

        Waits for in-flight gradient communication and removes every hook registered on the
        model (the used-parameter hooks here, the strategy's gradient hooks; stage 3 also its
        module hooks and attribute guards). Afterwards backward fills `param.grad` as plain
        PyTorch does, and `backward` / `step` raise. Gradients of an unfinished
        accumulation window are dropped. Idempotent.

        Stages 0-2: local; the parameters keep their current values (stages 1-2: as views of the
        flat parameter buffer, which costs nothing more than before). Stage 3: collective (every
        rank must call it), one all-gather of every released parameter, after which each rank
        holds the full parameters (Ψ·p bytes); the shards, masters and optimizer state are freed
        with this object. With offload to NVMe (any stage) the swap files are deleted here.
        """
        Detachable.close(self)

    def _detach(self) -> None:
        try:
            self.strategy.close()  # ZeRO-Infinity: may raise OffloadIOError, on every rank
        finally:  # offload_optimizer nvme: the swap files go now, not when collected
            getattr(self.optimizer, "close", lambda: None)()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"{what}() on a closed ZeroOptimizer: close() handed the model back to plain "
                f"PyTorch; call zero.shard(model, fresh_optimizer) again to train it with ZeRO"
            )

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer(stage={self.config.stage}, inner={type(self.optimizer).__name__}, "
            f"dtype={self.precision.param_dtype}, global_step={self.global_step}, {self.loss_scaler})"
        )


def _used_marker(used: bytearray, k: int) -> Callable[[nn.Parameter], None]:
    """The hook that marks parameter `k` used in this window (`ZeroOptimizer._used`)."""

    def mark(_param: nn.Parameter) -> None:
        used[k] = 1

    return mark


# Elements squared by one `_foreach_mul` in `_clip`: the temporaries it holds at once are at most
# max(this, the largest gradient) · 4 bytes, as the per-tensor loop's were the largest one's.
_SQUARES_NUMEL = 1 << 16


def _device_of(masters: list[list[Tensor]]) -> torch.device:
    for ms in masters:
        for m in ms:
            if m.device.type != "meta":  # ZeRO-Infinity's masters are meta handles
                return m.device
    return torch.device("cpu")


_log = get_logger("zero")
