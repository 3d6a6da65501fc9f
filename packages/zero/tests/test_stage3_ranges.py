"""Stage 3 marks its collectives with named ranges, so a profiler trace shows them by name.

A training step of TinyGPT on 2 ranks, recorded by torch.profiler: ``zero3.gather`` (forward and
backward all-gathers), ``zero3.release`` and ``zero3.reduce_scatter`` appear.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed


def _body(rank: int, world_size: int) -> list[str]:
    model = make_model()
    cfg = zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=0)
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    batch = rank_slice(make_batches(1, 8)[0], rank, world_size)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.backward(model(*batch))
        opt.step()
    return sorted({e.name for e in prof.events() if e.name.startswith("zero3.")})


def test_stage3_collectives_are_named_ranges() -> None:
    for names in run_distributed(_body, world_size=2, timeout_s=120):
        assert names == ["zero3.gather", "zero3.reduce_scatter", "zero3.release"], names
