"""Every schedule trains exactly like the unsplit model: 2 and 4 stages, and 2 stages × 2 data
parallel, 10 steps, same losses and parameters (fp32, 1e-5 relative), tied embeddings included."""

import pytest
import torch
from pipeline_testlib import reference, tiny_gpt, train_pipeline

from minispeed.core.testing import run_distributed

STEPS, BATCH, BLOCKS = 10, 8, 8
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2)]


def _all_schedules(rank, world_size, stages, micro_batches):
    return {
        name: train_pipeline(
            rank, world_size, stages, name, STEPS, BATCH, micro_batches, v, blocks=BLOCKS
        )
        for name, v in SCHEDULES
    }


@pytest.mark.parametrize(
    "world_size,stages,micro_batches",
    [(2, 2, 4), (4, 4, 4), (4, 2, 2)],
    ids=["pp2", "pp4", "pp2xdp2"],
)
def test_every_schedule_matches_the_unsplit_model(world_size, stages, micro_batches):
    ref_losses, ref_params = reference(tiny_gpt(BLOCKS), STEPS, BATCH)
    results = run_distributed(_all_schedules, world_size=world_size, args=(stages, micro_batches))
    for rank, per_schedule in enumerate(results):
        for name, res in per_schedule.items():
            torch.testing.assert_close(
                res["losses"], ref_losses, rtol=1e-5, atol=0, msg=f"{name} rank {rank}"
            )
            assert res["params"], name
            for key, value in res["params"].items():
                torch.testing.assert_close(
                    value, ref_params[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}"
                )
    # every parameter of the unsplit model lives on some stage
    held = {k for per in results for k in per["1f1b"]["params"]}
    assert held == set(ref_params)
