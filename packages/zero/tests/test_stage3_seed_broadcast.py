"""Ranks seeded differently train rank 0's model under stage 3, with and without zero.Init.

``torch.manual_seed(rank)`` before building the model is a common habit (for data order). Stage 3
keeps only each rank's slice of every parameter, so without a broadcast the model was stitched
from N initialisations, silently. Now partitioning starts from the first rank's values: the
losses equal single-process PyTorch on the model built with rank 0's seed.
"""

from __future__ import annotations

import torch
from stage3_testlib import GLOBAL_BATCH, LR, global_loss, reference_losses
from zero_testlib import TinyGPT, make_batches, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3 import Init

STEPS = 3


def _train(rank: int, world_size: int, use_init: bool) -> list[float]:
    torch.manual_seed(rank)  # rank 0 builds make_model()'s weights (seed 0), rank 1 others
    if use_init:
        with Init():
            model = TinyGPT()
    else:
        model = TinyGPT()
    opt = zero.shard(
        model, torch.optim.AdamW(model.parameters(), lr=LR), config=zero.ZeroConfig(stage=3)
    )
    losses = []
    for batch in make_batches(STEPS, GLOBAL_BATCH):
        loss = model(*rank_slice(batch, rank, world_size))
        losses.append(global_loss(loss, world_size))
        opt.backward(loss)
        opt.step()
    return losses


def _body(rank: int, world_size: int) -> dict:
    return dict(shard=_train(rank, world_size, False), init=_train(rank, world_size, True))


def test_ranks_seeded_differently_train_rank0s_model() -> None:
    results = run_distributed(_body, world_size=2, timeout_s=120)
    want = reference_losses(STEPS)
    for res in results:
        for how in ("shard", "init"):
            for a, b in zip(res[how], want, strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (how, res[how], want)
