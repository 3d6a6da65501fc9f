"""`ZeroOptimizer.backward` and `step` are named ranges (`zero.backward`, `zero.step`), so a
torch.profiler (or Nsight) trace shows the phases by name (`minispeed.core.ranges`)."""

from __future__ import annotations

import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed


def _names(rank: int, world_size: int) -> list[str]:
    model = make_model()
    opt = zero.shard(model, torch.optim.AdamW(model.parameters()), zero.ZeroConfig(stage=2))
    x, y = rank_slice(make_batches(1, 4)[0], rank, world_size)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.backward(model(x, y))
        opt.step()
    return sorted({e.name for e in prof.events() if e.name.startswith("zero.")})


def test_backward_and_step_are_named_ranges() -> None:
    for names in run_distributed(_names, world_size=2):
        assert {"zero.backward", "zero.step"} <= set(names), names
