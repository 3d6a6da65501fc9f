"""Stages 0, 1 and 2 train TinyGPT to the same losses as single-process PyTorch (fp32, 20 steps).

One distributed run per (stage, world size) checks several configurations in sequence, each
against plain PyTorch on the same global batches:

- AdamW, no accumulation, no clipping, ~4k-element buckets (several overlapped collectives);
- SGD with momentum, 2 accumulation steps, clipping at 0.5 (active), one reduction bucket,
  synchronous collectives and, for stages 1-2, all-reduce instead of reduce-scatter and the
  parameter all-gather split into 1000-element calls.

(Plain Adam takes the AdamW path of torch.optim; it is covered by the precision tests.)

Losses must agree to a relative 1e-5 at every step. For SGD the final weights must agree too; for
Adam(W) they need not (Adam divides by sqrt(v): an element whose true gradient is 0, such as
attention's key bias, moves by ±lr depending on the sign of rounding noise), but the parameter no
forward uses must be bit-identical to PyTorch's, which skips it (Note [unused parameters]).
"""

from __future__ import annotations

import pytest
import torch
from stage012_testlib import max_relative_error, reference_run, zero_run

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

CASES = [
    dict(
        kind="adamw",
        accumulation=1,
        clip=0.0,
        bucket=4000,
        gather=4000,
        overlap=True,
        reduce_scatter=True,
    ),
    dict(
        kind="sgd",
        accumulation=2,
        clip=0.5,
        bucket=10**9,
        gather=1000,
        overlap=False,
        reduce_scatter=False,
    ),
]


def _train_cases(rank: int, world_size: int, stage: int):
    results = []
    for case in CASES:
        config = zero.ZeroConfig(
            stage=stage,
            gradient_accumulation_steps=case["accumulation"],
            max_grad_norm=case["clip"],
            reduce_bucket_numel=case["bucket"],
            allgather_bucket_numel=case["gather"],
            overlap_comm=case["overlap"],
            reduce_scatter=case["reduce_scatter"],
        )
        losses, weights, opt = zero_run(rank, world_size, case["kind"], config)
        results.append((losses, weights, opt.global_step))
    return results


@pytest.mark.parametrize("world_size", [2, 4], ids=["ws2", "ws4"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_losses_match_pytorch(stage: int, world_size: int) -> None:
    per_rank = run_distributed(_train_cases, world_size=world_size, args=(stage,), timeout_s=180)
    for case, (losses, weights, steps) in zip(CASES, per_rank[0]):
        ref_losses, ref_weights, clipped = reference_run(case["kind"], case["clip"])
        if case["clip"]:
            assert clipped > 0, "the clipping case must actually clip"
        assert steps == len(ref_losses)
        assert max_relative_error(losses, ref_losses) <= 1e-5, (case, losses, ref_losses)
        # Parameters stay replicated: every rank ends with the same model.
        for other in per_rank[1:]:
            for name, w in other[CASES.index(case)][1].items():
                torch.testing.assert_close(w, weights[name], rtol=0, atol=0)
        assert torch.equal(weights["unused"], ref_weights["unused"]), "an unused parameter moved"
        if case["kind"] == "sgd":
            for name, w in weights.items():
                torch.testing.assert_close(w, ref_weights[name], rtol=1e-5, atol=1e-5, msg=name)
