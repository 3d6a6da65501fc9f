"""1-bit optimizers by name with ZeRO: refused on every rank until implemented (issue 20 §4).

`OneBitAdam` through `initialize()` used to train nothing at stage 0 (zero's fp32 masters do
not require grad, and a 1-bit optimizer steps only parameters that do) and, at stages 1-3,
to average different ranks' shards together in its own all-reduce. Both were silent.
"""

from __future__ import annotations

import pytest
import torch

from minispeed.core.testing import run_distributed


def _initialize(rank, world_size, kind, stage):
    import minispeed.engine as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": kind, "params": {"lr": 1e-2, "freeze_step": 2}},
        "zero_optimization": {"stage": stage},
    }
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except TypeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["OneBitAdam", "OneBitLamb"])
@pytest.mark.parametrize("stage", [0, 2])
def test_onebit_optimizers_under_zero_are_refused_on_every_rank(kind, stage):
    messages = run_distributed(_initialize, world_size=2, args=(kind, stage), timeout_s=60)
    assert all(m is not None and "issue 20" in m for m in messages), messages
