"""Universal checkpoints: saved by 2 ranks at stage 2, training continues on 4 ranks at stage 1
or 3 and on 1 rank at stage 0, on the loss trajectory of an uninterrupted plain-PyTorch run."""

from __future__ import annotations

import pytest
import torch
from ckpt_testlib import build, reference_losses, train

from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import load_checkpoint, save_checkpoint


def _save_body(rank: int, world_size: int, stage: int, path: str) -> list[float]:
    model, opt = build(stage)
    losses = train(model, opt, rank, world_size, range(0, 3))
    save_checkpoint(opt, model, path)
    return losses


def _continue_body(rank: int, world_size: int, stage: int, path: str) -> list[float]:
    model, opt = build(stage, seed=99)  # other initial weights: all must come from the checkpoint
    load_checkpoint(opt, model, path)
    assert opt.global_step == 3
    return train(model, opt, rank, world_size, range(3, 6))


@pytest.fixture(scope="module")
def saved_on_2_ranks_stage2(tmp_path_factory):
    path = tmp_path_factory.mktemp("universal")
    first = run_distributed(_save_body, world_size=2, args=(2, str(path)), timeout_s=120)
    return path, first[0]


@pytest.mark.parametrize(
    "world_size,stage",
    [(4, 1), (4, 3), (1, 0)],
    ids=["4ranks-stage1", "4ranks-stage3", "1rank-stage0"],
)
def test_training_continues_on_another_world_size_and_stage(
    saved_on_2_ranks_stage2, world_size, stage
):
    path, first_three = saved_on_2_ranks_stage2
    reference = reference_losses()
    torch.testing.assert_close(first_three, reference[:3], rtol=1e-5, atol=1e-6)
    results = run_distributed(
        _continue_body, world_size=world_size, args=(stage, str(path)), timeout_s=120
    )
    for losses in results:
        torch.testing.assert_close(losses, reference[3:], rtol=1e-5, atol=1e-6)
