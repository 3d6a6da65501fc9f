"""Ranks seeded differently train rank 0's model under stage 3, with and without zero.Init, and
at every stage when a part of it is frozen.

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


def _frozen_model() -> torch.nn.Module:
    """A frozen "text encoder" (as a diffusion script's) before a trained head."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    model[0].requires_grad_(False)
    return model


def _frozen_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS)]


def _train_frozen(rank: int, world_size: int) -> dict:
    out = {}
    for stage in range(4):
        torch.manual_seed(rank)  # the frozen encoder too is drawn differently on each rank
        model = _frozen_model()
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = zero.shard(model, torch.optim.AdamW(trained, lr=LR), zero.ZeroConfig(stage=stage))
        losses = []
        for x, y in _frozen_batches():
            loss = torch.nn.functional.mse_loss(model(x[rank::world_size]), y[rank::world_size])
            losses.append(loss.item())
            opt.backward(loss)
            opt.step()
        out[stage] = losses
    return out


def test_frozen_parameters_start_from_rank0s_too() -> None:
    """Parameters left out of the optimizer (a frozen encoder) are rank 0's on every rank at
    every stage, as DeepSpeed broadcasts every parameter at `initialize`: stages 0-2 used to
    broadcast the trained ones only, so rank 1 kept its own encoder, silently."""
    torch.manual_seed(0)
    model = _frozen_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    want = [[], []]
    for x, y in _frozen_batches():
        halves = [torch.nn.functional.mse_loss(model(x[r::2]), y[r::2]) for r in range(2)]
        (sum(halves) / 2).backward()
        opt.step()
        opt.zero_grad()
        for r in range(2):
            want[r].append(halves[r].item())
    results = run_distributed(_train_frozen, world_size=2, timeout_s=120)
    for rank, res in enumerate(results):
        for stage in range(4):
            for a, b in zip(res[stage], want[rank], strict=True):
                assert abs(a - b) <= 1e-5 * abs(b), (rank, stage, res[stage], want[rank])
