"""What stages 0, 1 and 2 share: parameters laid out in flat buckets, reduced by a reducer.

`BucketedStrategy` is the base of `ReplicatedStrategy` (stage 0, stage0.py) and
`PartitionedStrategy` (stages 1-2, stage12.py): each param group's parameters in one
`FlatLayout` (flat.py) of buckets of ``bucket_numel`` elements, and one reducer (reducer.py)
whose gradient hooks launch each bucket's all-reduce or reduce-scatter as its gradients are
ready. The stages differ in what they keep (whole masters, or this rank's partition) and in
how the reduced gradients reach the optimizer; the plumbing below is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import ShardStrategy, param_names
from minispeed.zero.flat import FlatLayout
from minispeed.zero.local_reducer import LocalReducer
from minispeed.zero.precision import MixedPrecision

__all__ = ["BucketedStrategy"]


class BucketedStrategy(ShardStrategy):
    """A `ShardStrategy` over flat buckets and a reducer (stages 0-2)."""

    #: (the reduced tensors, per group per parameter views of them): `_views_of`'s cache.
    _grad_views: tuple[list[torch.Tensor], list[list[torch.Tensor]]] | None = None

    # reducer.py's AllReduceReducer, BoundaryScatterReducer or BackwardScatterReducer; after
    # `go_local`, a LocalReducer. Written only by `_reduce_with` and `go_local`.
    _reducer: Any
    pad: bool  # every bucket padded to a multiple of the group size (stages 1-2: it is split)

    def __init__(
        self,
        model: nn.Module,
        config: ZeroConfig,
        precision: MixedPrecision,
        group: Any = None,
        *,
        param_groups: Sequence[Sequence[nn.Parameter]],
        grad_divisor: int | None = None,
    ) -> None:
        """Lay the param groups out in flat buckets, then the stage's masters and reducer
        (`_set_up`). `grad_divisor`: what the reduced gradient sum is divided by (default: the
        size of `group`; Note [replica groups] in replica_groups.py)."""
        self._lay_out(model, config, precision, group, param_groups)
        self._set_up(model, group, grad_divisor)

    def _set_up(self, model: nn.Module, group: Any, grad_divisor: int | None) -> None:
        """The stage's masters and its reducer (`_reduce_with`), over `self.layouts`."""
        raise NotImplementedError

    def _lay_out(
        self,
        model: nn.Module,
        config: ZeroConfig,
        precision: MixedPrecision,
        group: Any,
        param_groups: Sequence[Sequence[nn.Parameter]],
    ) -> None:
        """Set `config`, `precision`, `groups` (the optimizer's param groups), `names` and one
        `FlatLayout` per group (padded when `pad`)."""
        self.config = config
        self.precision = precision
        self.groups = [list(ps) for ps in param_groups]
        self.names = param_names(model)
        bucket_numel = config.bucket_numel(precision.grad_accum_dtype.itemsize)
        world_size = comm.get_world_size(group)
        # torch.autocast's safe gradients travel in 16 bits at stages 1-2, not at stage 0
        # (DeepSpeed's all-reduce sends fp32 there): minispeed/zero/autocast.py.
        wire = precision.autocast.wire_dtypes(model) if precision.autocast and self.pad else {}
        self.layouts = [
            FlatLayout(ps, bucket_numel, world_size, self.pad, [wire.get(p) for p in ps])
            for ps in self.groups
        ]

    def _views_of(
        self,
        reduced: list[torch.Tensor],
        make: Callable[[], list[list[torch.Tensor]]],
    ) -> list[list[torch.Tensor]]:
        """Per group per parameter views of the `reduced` tensors, made by `make` once and kept
        while the reducer returns the same tensors (fp32 gradients, reduced in place): the views
        `master_grads` hands out cost no tensor op per parameter per step."""
        cached = self._grad_views
        if cached is None or any(a is not b for a, b in zip(cached[0], reduced)):
            self._grad_views = (reduced, make())
        return self._grad_views[1]

    def _reduce_with(
        self, reducer: type, model: nn.Module, group: Any, grad_divisor: int | None
    ) -> None:
        """Build `reducer` over the layouts; it registers the gradient hooks."""
        self._position = {p: k for k, p in enumerate(model.parameters())}
        self._reducer = reducer(
            self.groups,
            self.layouts,
            self.config,
            self.precision.grad_accum_dtype,
            self.names,
            self._position,
            group,
            grad_divisor,
        )

    @property
    def reducer(self) -> Any:
        """The gradient schedule: the stage's (reducer.py), or `LocalReducer` after `go_local`."""
        return self._reducer

    def go_local(self, group: Any) -> None:
        """1-bit Adam's freeze (onebit.py): from now on each rank keeps its own gradient. The
        stage's reducer (its hooks removed) gives way to a `LocalReducer` over the same param
        groups, whose average is over nothing (`group` only names the ranks). Once, between
        steps."""
        assert not isinstance(self._reducer, LocalReducer), "go_local called twice"
        self._reducer.remove_hooks()
        self._reducer = LocalReducer(
            self.groups,
            self.config,
            self.precision.grad_accum_dtype,
            self.names,
            self._position,
            group,
        )

    def backward_begins(self, is_boundary: bool) -> None:
        """Tell the hooks whether this backward ends the window (they reduce then)."""
        self.reducer.backward_begins(is_boundary)

    def backward_done(self, is_boundary: bool) -> None:
        """Wait for the bucket reductions launched by the hooks; average at the boundary."""
        self.reducer.backward_done(is_boundary)

    def zero_grad(self) -> None:
        """Clear the accumulated gradients (and gradient partitions)."""
        self.reducer.zero_grad()

    def close(self) -> None:
        """Wait for in-flight reductions and remove the gradient hooks (idempotent, local).

        Afterwards the model's backward fills `param.grad` as in plain PyTorch. This strategy
        must not be used again.
        """
        self.reducer.remove_hooks()

    def _in_group_order(self, params: Sequence[nn.Parameter]) -> bool:
        """Whether `params` are the param groups' parameters, in order (the reducer's marks')."""
        ours = [p for ps in self.groups for p in ps]
        return len(ours) == len(params) and all(a is b for a, b in zip(ours, params))

    def carry_flags(self, params: Sequence[nn.Parameter]) -> bool:
        """Whether the optimizer's per-parameter flags (one per element of `params`, which must
        be the param groups' parameters in order) now travel in the last gradient bucket's
        all-reduce (stage 0 with no loss scaling: Note [the flags ride with the last bucket] in
        reducer.py). The same answer on every rank: it depends on the config and layout only."""
        carry = getattr(self.reducer, "carry_flags", None)
        if carry is None or self.precision.uses_loss_scaling:
            return False
        return self._in_group_order(params) and carry(self.groups)

    def marks_used(self, params: Sequence[nn.Parameter]) -> bool:
        """The reducer sees every gradient: its marks serve the optimizer when `params` are the
        param groups' in order (Note [the reducer marks the used parameters] in reducer.py)."""
        return self._in_group_order(params)

    def used_marks(self) -> bytearray:
        """The reducer's marks of the window (`take_window_marks`), in param-group order."""
        return self.reducer.take_window_marks()

    def carried_flags(self, trainable: Sequence[bool]) -> list[float]:
        """The flags summed with this window's last bucket, in `ZeroOptimizer._agree`'s layout:
        [2 + the last parameter frozen at `shard()` (`trainable[k]` False) that requires grad
        now on some rank, else 0; then 1.0 per parameter some rank used]."""
        summed = self.reducer.carried_flags()
        if summed is None:
            raise RuntimeError(
                "the window's last gradient bucket was not reduced with the flags (Note [the "
                "flags ride with the last bucket] in reducer.py); drive every micro-step through "
                "ZeroOptimizer.backward(loss)"
            )
        summed = summed.tolist()  # the one host sync of the step
        unfrozen = [k for k, (f, t) in enumerate(zip(summed, trainable)) if f > 0 and not t]
        first = float(unfrozen[-1] + 2) if unfrozen else 0.0
        return [first] + [1.0 if f > 0 and t else 0.0 for f, t in zip(summed, trainable)]

    def bucket_numels(self) -> list[int]:
        """Elements of each gradient reduce call (padded at stages 1-2), in launch order (for
        the ledger)."""
        return self.reducer.bucket_numels()
