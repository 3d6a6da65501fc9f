"""Every rank must pass `initialize` the same ds_config and model (engine/agreement.py): a
difference raises the same `ConfigError` on every rank, naming each differing key or parameter
and each rank's value, before any collective that depends on it. Before, a different ZeRO stage
or bucket size surfaced as a mismatched collective inside the set-up, and a different batch size
trained silently, each rank weighting its gradients differently. The monitors' sections may
differ (a per-rank output path)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minispeed.engine as deepspeed
from minispeed.core.config import ConfigError
from minispeed.core.testing import run_distributed


def _build(rank: int, world_size: int, differ: str) -> str:
    torch.manual_seed(0)
    width = 3 if differ == "model" and rank == 1 else 2
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, width))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "tensorboard": {"enabled": False, "output_path": f"/tmp/tb-{rank}"},
    }
    if differ == "batch":
        cfg["train_micro_batch_size_per_gpu"] = 2 + rank
    if differ == "stage":
        cfg["zero_optimization"]["stage"] = 2 + rank
    try:
        engine, *_ = deepspeed.initialize(model=model, config=cfg)
    except ConfigError as e:
        return str(e)
    loss = engine(torch.randn(2, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    return "trained"


@pytest.mark.parametrize(
    "differ, named",
    [
        ("batch", "key 'train_micro_batch_size_per_gpu': rank 0: 2, rank 1: 3"),
        ("stage", "key 'zero_optimization.stage': rank 0: 2, rank 1: 3"),
        (
            "model",
            "parameter '2.weight': rank 0: [[2, 16], 'torch.float32', True], rank 1: [[3, 16]",
        ),
        ("none", None),
    ],
)
def test_ranks_that_differ_are_named_on_every_rank(differ: str, named: str | None) -> None:
    results = run_distributed(_build, world_size=2, timeout_s=120, args=(differ,))
    for rank, msg in enumerate(results):
        if named is None:  # only the monitor's output path differs
            assert msg == "trained", f"rank {rank}: {msg}"
        else:
            assert named in msg, f"rank {rank}: {msg}"
            assert "every rank must pass initialize() the same config" in msg
