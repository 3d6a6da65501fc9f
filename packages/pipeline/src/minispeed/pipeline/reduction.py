"""The data-parallel gradient average of one stage, joined by every rank even after a failure.

`GradientAverager.reduce()` runs the `ReduceGrads` instruction: flatten this stage's gradients
into one buffer, all-reduce it over the grid's `data` group, divide by N and copy back. Bytes sent
per rank and step: 2(N−1)/N · Ψ_stage · 4 (fp32 ring all-reduce); one call.

A rank that failed earlier in the batch (`stand_in=True`), or whose flattening fails, all-reduces
zeros of the same size and dtype instead, from the same line (the comm layer checks the first call
of each call site across ranks, so both paths must be one site): its peers are never left
waiting, and the error is returned, not raised, for the end-of-batch agreement to raise on every
rank (Note [every rank reaches the agreement] in `status.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.core import ranges

__all__ = ["GradientAverager"]


class GradientAverager:
    """Averages the gradients of `params()` over `group` (of `size` ranks)."""

    def __init__(
        self,
        params: Callable[[], Iterable[nn.Parameter]],
        group: Any,
        size: int,
        device: torch.device,
    ) -> None:
        self.params, self.group, self.size, self.device = params, group, size, device

    def reduce(self, stand_in: bool = False) -> Exception | None:
        """One all-reduce of the flattened gradients; see the module docstring."""
        if self.size == 1:
            return None
        err: Exception | None = None
        with ranges.range("pipeline.reduce_grads"):
            params = [q for q in self.params() if q.requires_grad]
            flat = None
            if not stand_in:
                try:
                    flat = self.flatten(params)
                except Exception as exc:
                    err = exc
            buf = flat if flat is not None else self.zeros_like_flat(params)
            comm.all_reduce(buf, group=self.group)
            if flat is not None:
                try:
                    self.unflatten(flat, params)
                except Exception as exc:
                    err = exc
        return err

    def flatten(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The gradients in one buffer (missing ones become zeros)."""
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        return torch.cat([q.grad.reshape(-1) for q in params])  # type: ignore[union-attr]

    def zeros_like_flat(self, params: list[nn.Parameter]) -> torch.Tensor:
        """The stand-in: zeros of the size and dtype `flatten` would give."""
        dtype = params[0].dtype
        for q in params[1:]:
            dtype = torch.promote_types(dtype, q.dtype)
        return torch.zeros(sum(q.numel() for q in params), dtype=dtype, device=self.device)

    def unflatten(self, flat: torch.Tensor, params: list[nn.Parameter]) -> None:
        """Divide the summed buffer by N and copy it back into each `.grad`."""
        flat /= self.size
        offset = 0
        for q in params:
            n = q.numel()
            q.grad.copy_(flat[offset : offset + n].view_as(q))  # type: ignore[union-attr]
            offset += n
