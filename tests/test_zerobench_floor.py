"""The compute floor of `benchmarks/zero_vs_torch.py` steps AdamW over values like a stage's.

Every ZeRO ratio of issue 34 is read against the floor (and a stage's limit, the floor plus its
collectives), so the floor must not be slower than the work it stands for. Its AdamW steps
stand-in shards with no model behind them; with zero gradients ``exp_avg_sq`` stayed 0, and
``sqrt`` of zeros is ~14x slower than of real values on this machine's CPU, which made the
floor's optimizer step ~75 ms too slow at 33.9M parameters (docs/benchmarks.md, "Stage 3's page
faults").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from minispeed.core.testing import run_distributed

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _floor_state(rank: int, world_size: int) -> tuple[int, int, int]:
    sys.path.insert(0, str(BENCHMARKS))
    from zerobench.contenders import FLOOR, SIZES, build

    args = argparse.Namespace(seed=0, checkpoint=False)
    names = ("n_layer", "n_head", "n_embd", "block_size", "micro_batch")
    vars(args).update(zip(names, SIZES["tiny"]))
    trainer = build(FLOOR, args, vocab=53)
    x = torch.randint(53, (args.micro_batch, args.block_size))
    trainer.step(x, x)
    _, shards, opt = trainer.keep
    stepped = sum(s.numel() for s in shards)
    zero_grads = sum(int((s.grad == 0).sum()) for s in shards)
    zero_second_moments = sum(int((opt.state[s]["exp_avg_sq"] == 0).sum()) for s in shards)
    return stepped, zero_grads, zero_second_moments


def test_the_floor_steps_adamw_over_nonzero_gradients() -> None:
    ((stepped, zero_grads, zero_second_moments),) = run_distributed(_floor_state, world_size=1)
    assert stepped > 0
    assert zero_grads == 0, (
        f"{zero_grads} of the floor's {stepped} stepped elements have a 0 gradient"
    )
    assert zero_second_moments == 0, f"{zero_second_moments} zeros in exp_avg_sq after a step"
