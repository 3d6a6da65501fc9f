"""Data-parallel replicas start from the same weights whatever each rank's RNG holds.

With `seed=None` (DeepSpeed's default `seed_layers: false`) every rank builds its layers from its
own RNG; ranks seeded differently used to start their replicas from different weights and train
apart without an error. `partition` now broadcasts each stage's parameters from the replica of
data rank 0 (DeepSpeed's engine does the same at build), so the run equals single-process
training started from those weights."""

import torch
from pipeline_testlib import reference, tiny_gpt, train_pipeline

from minispeed.core.testing import run_distributed

STEPS, BATCH, BLOCKS = 3, 8, 4


def _train_seeded_apart(rank, world_size):
    torch.manual_seed(1000 + rank)  # every rank's RNG differs
    return train_pipeline(rank, world_size, 2, "1f1b", STEPS, BATCH, 2, blocks=BLOCKS, seed=None)


def test_ranks_seeded_differently_train_like_one_process():
    results = run_distributed(_train_seeded_apart, world_size=4, timeout_s=90)
    # grid: global rank = 2 · stage + replica; replica 0 of each stage gives the start
    start = {**results[0]["start"], **results[2]["start"]}
    for a, b in ((0, 1), (2, 3)):  # the two replicas of a stage start equal
        for key, value in results[a]["start"].items():
            torch.testing.assert_close(results[b]["start"][key], value, rtol=0, atol=0)
    ref_losses, ref_params = reference(tiny_gpt(BLOCKS), STEPS, BATCH, start=start)
    for rank, res in enumerate(results):
        torch.testing.assert_close(res["losses"], ref_losses, rtol=1e-5, atol=0)
        for key, value in res["params"].items():
            torch.testing.assert_close(
                value, ref_params[key], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}"
            )
