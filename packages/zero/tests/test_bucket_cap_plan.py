"""`reduce_bucket_numel` is an upper bound: buckets are cut at `BUCKET_CAP_BYTES` at most
(`core.gradient_buckets`; Note [bucket sizes are upper bounds], config.py), at every stage, with
the same losses.

The cap is lowered to 2 KiB for the test (PyTorch DDP's 25 MiB otherwise) and the model is six
16x16 linears of 1,088 bytes each, so DeepSpeed's default bound (5e8 elements: one bucket of the
whole model) becomes at least four buckets (6,528 bytes at <= 2 KiB each) instead of one, none
above the cap, and losses equal, bit for bit, to the run with the real cap (one bucket).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minispeed.comm as comm
import minispeed.core.gradient_buckets as gradient_buckets
import minispeed.zero as zero
from minispeed.core.testing import run_distributed

WIDTH, DEPTH, STEPS = 16, 6, 2
CAP = 2048  # bytes: one linear's fp32 gradient (1,088 B) fits, two do not


def _data() -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(11))


def _train(rank: int, world_size: int, stage: int, cap: int) -> dict:
    gradient_buckets.BUCKET_CAP_BYTES = cap
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH))
    )
    cfg = zero.ZeroConfig.from_section({"stage": stage})
    assert cfg.reduce_bucket_numel == 500_000_000  # DeepSpeed's default bound
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    n = 8 // world_size
    x = _data()[rank * n : (rank + 1) * n]
    losses, reductions = [], []
    for _ in range(STEPS):
        loss = model(x).pow(2).mean()
        with comm.CommsLogger() as log:  # the gradient reductions (the step's flags excluded)
            opt.backward(loss)
        opt.step()
        losses.append(loss.item())
        reductions.append(
            [
                r.msg_bytes
                for r in log.records
                if r.op.startswith(("all_reduce", "reduce_scatter")) and r.dtype == "torch.float32"
            ]
        )
    return dict(losses=losses, reductions=reductions[-1])


def _body(rank: int, world_size: int, stage: int) -> dict:
    default = gradient_buckets.BUCKET_CAP_BYTES
    try:
        return dict(
            capped=_train(rank, world_size, stage, CAP),
            real=_train(rank, world_size, stage, default),
        )
    finally:  # the worker process serves later tests
        gradient_buckets.BUCKET_CAP_BYTES = default


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_buckets_are_cut_at_the_cap_with_equal_losses(stage: int) -> None:
    for res in run_distributed(_body, world_size=2, args=(stage,), timeout_s=120):
        capped, real = res["capped"], res["real"]
        total = DEPTH * (WIDTH * WIDTH + WIDTH) * 4  # fp32 gradient bytes of the model
        assert len(real["reductions"]) == 1 and real["reductions"][0] >= total
        assert len(capped["reductions"]) >= -(-total // CAP), capped["reductions"]
        assert all(b <= CAP for b in capped["reductions"]), capped["reductions"]
        # Stages 1-3 pad each bucket (each parameter at stage 3) to a multiple of N = 2 elements;
        # at stage 0 the last bucket also carries one fp32 flag per parameter (Note [the flags
        # ride with the last bucket] in reducer.py).
        flags = 4 * 2 * DEPTH if stage == 0 else 0
        assert 0 <= sum(capped["reductions"]) - total - flags <= 4 * len(capped["reductions"])
        assert capped["losses"] == real["losses"]


def test_bucket_numel_is_the_smaller_of_the_bound_and_the_cap() -> None:
    cfg = zero.ZeroConfig(stage=2)
    assert cfg.bucket_numel(4) == 25 * 2**20 // 4
    assert cfg.bucket_numel(2) == 25 * 2**20 // 2
    assert zero.ZeroConfig(stage=2, reduce_bucket_numel=1000).bucket_numel(4) == 1000
