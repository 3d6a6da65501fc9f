"""Stage 0: plain data parallelism, with gradients all-reduced in buckets while backward runs.

Every rank keeps everything: the model parameters, the full gradients, the fp32 masters and the
whole optimizer state. It is the baseline the partitioned stages are measured against, and the
simplest `ShardStrategy`: masters are per-parameter tensors, so the user's optimizer sees the
same tensors (shapes, order) it would see without minispeed.

Bytes kept per rank (Ψ parameters; p, g = bytes per param / grad element; K = optimizer state
bytes per parameter, 8 for Adam):

- fp32:   Ψ·4 (params, which double as the masters) + Ψ·4 (grads) + Ψ·K
- 16-bit: Ψ·p + Ψ·g + Ψ·4 (masters) + Ψ·K       (mixed-precision Adam: 2Ψ + 4Ψ + 12Ψ with fp32
  gradient accumulation, the textbook 2Ψ + 2Ψ + 12Ψ with `grad_accum_dtype=param_dtype`)

Bytes sent per optimizer step: one all-reduce of the Ψ gradient elements, 2(N-1)/N · Ψ · g per
rank on a ring (`ledger.stage_collectives`); nothing between accumulation boundaries. With no loss
scaling the optimizer's m per-parameter flags ride in the last bucket (m·4 bytes more in it, one
collective fewer: Note [the flags ride with the last bucket] in reducer.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minispeed.zero.bucketed import BucketedStrategy
from minispeed.zero.contract import ParamFragment
from minispeed.zero.reducer import AllReduceReducer

__all__ = ["ReplicatedStrategy"]

# Note [fp32 stage 0 has no master copy]
# With fp32 parameters the "master" of a parameter is a detached alias of the parameter itself
# (same storage): the optimizer's in-place update is the model update, publish_params has nothing
# to copy, and no second Ψ·4 bytes are spent. 16-bit parameters get a real fp32 copy.


class ReplicatedStrategy(BucketedStrategy):
    """ZeRO stage 0: replicated parameters and optimizer state, bucketed gradient all-reduce.

    `grad_divisor`: what the reduced gradient sum is divided by (default: the size of `group`;
    Note [replica groups] in replica_groups.py).
    """

    partitions_grads = False  # every rank holds the full averaged gradient: the norm is local

    pad = False

    def _set_up(self, model: nn.Module, group: Any, grad_divisor: int | None) -> None:
        """Full fp32 masters (Note [fp32 stage 0 has no master copy]), the all-reduce reducer."""
        precision = self.precision
        dtype = precision.param_dtype
        self._masters: list[list[torch.Tensor]] = []
        for ps in self.groups:
            masters = []
            for p in ps:
                if precision.needs_master_copy:
                    masters.append(
                        p.detach().to(torch.float32, copy=True)
                    )  # from the fp32 original
                    p.data = p.data.to(dtype)
                else:
                    p.data = p.data.to(torch.float32)
                    masters.append(p.detach())  # See Note [fp32 stage 0 has no master copy]
            self._masters.append(masters)

        self._reduce_with(AllReduceReducer, model, group, grad_divisor)

    def master_params(self) -> list[list[torch.Tensor]]:
        """Per group, one fp32 tensor per parameter, full size."""
        return self._masters

    def master_grads(self) -> list[list[torch.Tensor]]:
        """Per group, views of the averaged fp32 flat gradient, one per parameter.

        The views are made once and kept while the reducer returns the same flat tensors (fp32
        gradients, reduced in place): two tensor ops per parameter per step saved."""
        flats = [ts[0] for ts in self.reducer.reduced()]
        return self._views_of(
            flats,
            lambda: [
                [flats[g][s.offset : s.offset + s.numel].view(s.shape) for s in lay.slots]
                for g, lay in enumerate(self.layouts)
            ],
        )

    @torch.no_grad()
    def publish_params(self) -> None:
        """Copy the stepped fp32 masters into the 16-bit parameters (nothing to do for fp32)."""
        if not self.precision.needs_master_copy:
            return
        for ps, masters in zip(self.groups, self._masters):
            for p, m in zip(ps, masters):
                p.copy_(m)

    def fragments(self) -> list[ParamFragment]:
        """Every parameter whole: rank-independent."""
        return [
            ParamFragment(self.names[p], p.shape, 0, p.numel(), g, i, 0)
            for g, ps in enumerate(self.groups)
            for i, p in enumerate(ps)
        ]
