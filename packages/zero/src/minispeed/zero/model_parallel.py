"""The model-parallel axes a ZeRO optimizer agrees over besides its data group.

```python
opt = zero.shard(stage_module, torch.optim.AdamW(stage_module.parameters()),
                 zero.ZeroConfig(stage=2, max_grad_norm=1.0),
                 group=grid.group("data"),                       # ZeRO partitions over this
                 model_parallel=zero.ModelParallel(
                     groups=(grid.group("pipe"),),               # the other axes of the grid
                     shared=((embed.weight, tie_group),),        # one parameter on 2 stages
                     counted_elsewhere=(embed.weight,)))         # on the last stage only
```

ZeRO partitions over the data group; under model parallelism (pipeline stages, tensor slices)
each rank of that group holds only one part of the model, and the other parts live on the
other ranks of the grid. Three decisions belong to the whole model, not to one part:

- **The gradient norm** that clipping divides by: each rank sums the squares of the gradient
  elements it owns (its shard, or its whole copy when the gradients are not partitioned), the
  sum is all-reduced over the data group when the gradients are partitioned, then over every
  group in `groups`, in order (for a grid, pipe then tensor: the sum over the plane). A
  parameter held by several model-parallel ranks (a tied embedding on the first and last
  stage, a layer norm replicated over tensor slices) must be counted once: every holder but
  one lists it in `counted_elsewhere`. The result is the norm of the unsplit model's gradient.
- **The step's verdict**: fp16 overflow, and an error found by the step's agreement (a
  parameter unfrozen after `shard`, a failed swap-file I/O). After the data group's agreement,
  one code per rank (0 clean, 1 overflow, 2 error) is all-reduced (MAX) over every group in
  `groups`: an overflow on one stage skips the step on every stage (so every rank's loss
  scale moves alike), and an error on one rank raises on all of them.
- **Shared gradients** (`shared`): a parameter whose copies on several model-parallel ranks
  are one parameter (tied layers) gets the sum of their gradients before the step, unscaling,
  the overflow check and the norm (Note [summing a shared gradient after the reduction]).

Cost per optimizer step, with `groups` given: one 4-byte all-reduce per group for the verdict,
one more per group for the norm when clipping; per shared parameter of W elements, one
all-reduce of W·4 bytes over the data group (partitioned gradients only) and one over its
group. Bytes kept: one W-element fp32 buffer per shared parameter, during the step only.

Note [summing a shared gradient after the reduction]
Within a pipeline the copies of a tied parameter get their gradients at different times (the
head's on the last stage in the first backward passes, the embedding's on the first stage in
the last), so they cannot be summed before ZeRO reduces each one over its data group inside
backward: a stage waiting in that sum would never send the gradients the other stage waits
for. Both operations are linear, so the order does not change the answer: at the step, every
holder rank writes its fragment of its (data-averaged) gradient into a zero buffer of the whole
parameter, all-reduces it over the data group (the fragments are disjoint and cover the
parameter: the stage's whole data-averaged gradient) and then over the shared parameter's
group (the sum over the holders), and copies its fragment back. Unpartitioned gradients skip
the data all-reduce (every rank already has the whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.zero.contract import ParamFragment

__all__ = ["ModelParallel", "SharedGrad"]

_CLEAN, _OVERFLOW, _ERROR = 0.0, 1.0, 2.0


@dataclass(frozen=True, eq=False)
class SharedGrad:
    """One parameter whose copies on the ranks of `group` are one parameter (tied layers)."""

    param: nn.Parameter
    """This rank's copy (a parameter of the model given to `zero.shard`)."""
    group: Any
    """The process group of the ranks holding a copy, this rank included (same data index)."""


@dataclass(frozen=True, eq=False)
class ModelParallel:
    """The other axes of a model-parallel grid, for `zero.shard(..., model_parallel=...)`.

    See the module docstring for what is reduced over them and the cost. Every rank of the grid
    passes its own groups (the ones it belongs to) in the same order.
    """

    groups: tuple[Any, ...] = ()
    """Process groups over which the gradient norm is summed and the step's verdict (overflow,
    errors) is agreed, after the data group: e.g. `(grid.group("pipe"),)`."""
    shared: tuple[SharedGrad | tuple[nn.Parameter, Any], ...] = ()
    """Parameters whose gradient is summed over their group before the step (tied layers);
    `(param, group)` pairs are accepted."""
    counted_elsewhere: tuple[nn.Parameter, ...] = ()
    """Parameters left out of this rank's share of the norm: a copy counted on another rank."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(
            self,
            "shared",
            tuple(s if isinstance(s, SharedGrad) else SharedGrad(*s) for s in self.shared),
        )
        object.__setattr__(self, "counted_elsewhere", tuple(self.counted_elsewhere))

    def check(self, params: Sequence[nn.Parameter]) -> None:
        """Refuse parameters `zero.shard` does not manage, naming the fix."""
        managed = {id(p) for p in params}
        for what, ps in (
            ("shared", [s.param for s in self.shared]),
            ("counted_elsewhere", list(self.counted_elsewhere)),
        ):
            for p in ps:
                if id(p) not in managed:
                    raise ValueError(
                        f"ModelParallel.{what} holds a tensor of shape {tuple(p.shape)} that is "
                        "not a parameter of the optimizer passed to zero.shard; list only this "
                        "rank's own parameters"
                    )

    def check_strategy(self, strategy: Any) -> None:
        """Refuse a stage that never holds its gradients in memory."""
        if (self.shared or self.counted_elsewhere) and strategy.grads_in_files:
            raise NotImplementedError(
                "ModelParallel.shared / counted_elsewhere with gradients in swap files "
                "(offload_param to nvme): the gradients are never in memory at once; offload to "
                "cpu instead"
            )

    def agree_step(self, overflow: bool, error: bool, device: torch.device) -> bool:
        """The step's verdict over `groups` (module docstring): whether any rank overflowed.

        Raises `RuntimeError` on a rank whose own step found nothing wrong when another rank's
        did (that rank raises its own error)."""
        if not self.groups:
            return overflow
        code = torch.tensor([_ERROR if error else _OVERFLOW if overflow else _CLEAN], device=device)
        for group in self.groups:
            comm.all_reduce(code, op=comm.ReduceOp.MAX, group=group)
        verdict = float(code.item())
        if verdict == _ERROR and not error:
            raise RuntimeError(
                "the optimizer step failed on another rank of the model-parallel grid (its error "
                "says why); no rank stepped"
            )
        return verdict == _OVERFLOW or overflow

    def sum_squares(self, sq: torch.Tensor) -> torch.Tensor:
        """The sum of squares over `groups` (`sq` already summed over the data group)."""
        if not self.groups:
            return sq
        travel = sq.to(comm.tensor_device(self.groups[0]))
        for group in self.groups:
            comm.all_reduce(travel, group=group)
        return travel.to(sq.device)

    def uncounted_indices(self, params: Sequence[nn.Parameter]) -> set[int]:
        """Positions in `params` of the parameters counted on another rank."""
        ids = {id(p) for p in self.counted_elsewhere}
        return {k for k, p in enumerate(params) if id(p) in ids}

    @torch.no_grad()
    def sum_shared(
        self,
        fragments: dict[str, ParamFragment],
        names: dict[nn.Parameter, str],
        grads: list[list[torch.Tensor]],
        data_group: Any,
        partitioned: bool,
    ) -> None:
        """Sum each shared parameter's gradient over its group, in place in `grads` (this rank's
        fragments); see Note [summing a shared gradient after the reduction]."""
        reduce_data = partitioned and comm.get_world_size(data_group) > 1
        for s in self.shared:
            frag = fragments[names[s.param]]
            mine = grads[frag.group][frag.master_index].view(-1)[: frag.numel]
            whole = torch.zeros(
                s.param.numel(), dtype=torch.float32, device=comm.tensor_device(s.group)
            )
            whole[frag.start : frag.start + frag.numel].copy_(mine)
            if reduce_data:
                comm.all_reduce(whole, group=data_group)
            comm.all_reduce(whole, group=s.group)
            mine.copy_(whole[frag.start : frag.start + frag.numel])
