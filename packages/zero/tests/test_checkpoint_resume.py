"""Resume on the same world size: steps after the reload repeat the uninterrupted run bit for bit."""

from __future__ import annotations

import pytest
import torch
from ckpt_testlib import build, train

from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import load_checkpoint, save_checkpoint


def _resume_body(rank: int, world_size: int, stage: int, dtype: torch.dtype, path: str):
    model, opt = build(stage, dtype=dtype)
    train(model, opt, rank, world_size, range(0, 3))
    save_checkpoint(opt, model, path, client_state={"epoch": 7})
    uninterrupted = train(model, opt, rank, world_size, range(3, 6))

    # Fresh objects with other initial weights: everything must come from the checkpoint.
    model2, opt2 = build(stage, seed=123, dtype=dtype)
    client = load_checkpoint(opt2, model2, path)
    resumed = train(model2, opt2, rank, world_size, range(3, 6))
    return uninterrupted, resumed, client, opt2.global_step


@pytest.mark.parametrize(
    "stage,dtype",
    [
        (0, torch.float32),
        (1, torch.float32),
        (2, torch.float32),
        (2, torch.bfloat16),
        (3, torch.float32),
        (3, torch.bfloat16),
    ],
    ids=["stage0", "stage1", "stage2", "stage2-bf16", "stage3", "stage3-bf16"],
)
def test_resume_gives_bit_identical_losses(tmp_path, stage, dtype):
    results = run_distributed(
        _resume_body, world_size=2, args=(stage, dtype, str(tmp_path)), timeout_s=120
    )
    for uninterrupted, resumed, client, global_step in results:
        assert resumed == uninterrupted  # exact float equality, steps 4-6
        assert client == {"epoch": 7}
        assert global_step == 6
    assert (tmp_path / "latest").read_text().strip() == "global_step3"
