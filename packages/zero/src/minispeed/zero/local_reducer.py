"""The "local" gradient schedule: accumulate each rank's own gradient and reduce nothing.

A fourth schedule beside `reducer.py`'s three, for optimizers that communicate something other
than the gradient: after 1-bit Adam's warm-up (`onebit.py`) each rank folds its *local*
gradient into its momentum and the momenta are averaged in 1 bit, so the fp32 gradient
reduction of stages 0-2 must not run at all.

| stage | reducer | micro-steps inside a window | the boundary micro-step |
|---|---|---|---|
| any | `LocalReducer` | accumulate into `flat_grads` | zero the missing slots; no collective |

The hooks, the launch order and Note [the first micro-step overwrites] are `reducer.py`'s
(`_FlatBufferGrads`); the layout is unpadded (`FlatLayout(pad=False)`), so `flat_grads[g]` is
param group g's parameters end to end, in order. The result is not averaged: `grad_divisor=1`.

Bytes kept per rank: Ψ·g (the full local gradient, g = bytes per `grad_accum_dtype` element),
whatever the stage: at stage 2 this is Ψ·g more than its gradient partition. Bytes sent: 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from minispeed.comm.buckets import InFlight
from minispeed.zero.config import ZeroConfig
from minispeed.zero.flat import Bucket, FlatLayout
from minispeed.zero.reducer import _FlatBufferGrads

__all__ = ["LocalReducer"]


class LocalReducer(_FlatBufferGrads):
    """Accumulate this rank's gradients into one unpadded flat buffer per group; never reduce.

    `reduced()` returns `[[flat_grads[g]]]`: the sum over the window's micro-steps of this rank's
    gradients (already divided by the accumulation steps through the loss scale, as every
    schedule's are), not averaged over ranks.
    """

    def __init__(
        self,
        groups: Sequence[Sequence[nn.Parameter]],
        config: ZeroConfig,
        grad_dtype: torch.dtype,
        names: dict[nn.Parameter, str],
        param_position: dict[nn.Parameter, int],
        group: Any = None,
    ) -> None:
        layouts = [
            FlatLayout(ps, config.bucket_numel(grad_dtype.itemsize), 1, pad=False) for ps in groups
        ]
        super().__init__(
            groups, layouts, config, grad_dtype, names, param_position, group, grad_divisor=1
        )

    def _launch(self, g: int, bk: Bucket, k: int) -> InFlight:
        if self._fresh:  # Note [the first micro-step overwrites] in reducer.py
            self._zero_missing(g, bk, self.flat_grads[g], 0)
        return InFlight(None)  # nothing to send: the gradient stays this rank's own

    def _results(self) -> list[list[torch.Tensor]]:
        return [[t] for t in self.flat_grads]

    def bucket_numels(self) -> list[int]:
        """No gradient collective: an empty list (for the ledger)."""
        return []

    def local_grads(self) -> list[list[torch.Tensor]]:
        """Per group, per parameter: a view (parameter-shaped) of its local gradient, valid at a
        boundary (after `backward_done(True)`)."""
        flats = self.reduced()
        return [
            [flats[g][0][s.offset : s.offset + s.numel].view(s.shape) for s in lay.slots]
            for g, lay in enumerate(self.layouts)
        ]
