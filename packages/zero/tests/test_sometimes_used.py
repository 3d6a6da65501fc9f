"""A parameter used in some micro-steps and on some ranks only.

Stages 0-2: its gradient buffer slot must read as zero where it got no gradient, although the
buffers are no longer zero-filled after a step (Note [the first micro-step overwrites] in
reducer.py). Stage 3: every rank must still issue the same reduce-scatters (Note [a fixed bucket
plan] in stage3/strategy.py; bucketing by arrival order aborted the process here).

``extra`` is used by micro-batch (step s, rank r, micro j) iff (s + r + j) % 3 == 0: every window
uses it somewhere, but on a given rank it is sometimes missing from the first micro-step, which
is the one that overwrites. Compared with single-process PyTorch over the same micro-batches.
Stages 0-2 also in one bucket, where no gradient hook runs and `backward_done` collects
`param.grad` (Note [a model in one bucket has no gradient hooks] in reducer.py): there a
parameter is marked used by the gradient autograd left it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

STEPS, ACCUM, WORLD, ROWS = 6, 2, 2, 4


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.extra = nn.Parameter(torch.randn(8))
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_extra:
            h = h * self.extra
        return self.b(h).pow(2).mean()


def _uses(step: int, rank: int, micro: int) -> bool:
    return (step + rank + micro) % 3 == 0


def _data(step: int, rank: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(ROWS, 8, generator=g)


def _optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def _reference() -> dict[str, torch.Tensor]:
    model = Model()
    opt = _optimizer(model.parameters())
    for s in range(STEPS):
        loss = sum(
            model(_data(s, r, j), _uses(s, r, j)) for r in range(WORLD) for j in range(ACCUM)
        ) / (WORLD * ACCUM)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _body(rank: int, world_size: int, stage: int, bucket_numel: int) -> dict[str, torch.Tensor]:
    model = Model()
    config = zero.ZeroConfig(
        stage=stage,
        gradient_accumulation_steps=ACCUM,
        reduce_bucket_numel=bucket_numel,
        stage3_param_persistence_threshold_numel=0,
    )
    opt = zero.shard(model, _optimizer(model.parameters()), config=config)
    for s in range(STEPS):
        for j in range(ACCUM):
            opt.backward(model(_data(s, rank, j), _uses(s, rank, j)))
            opt.step()
    if stage == 3:
        with zero.GatheredParameters(list(model.parameters())):
            return {k: v.detach().clone() for k, v in model.named_parameters()}
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize(
    ("stage", "bucket_numel"),
    [(0, 40), (1, 40), (2, 40), (3, 40), (0, 1000), (1, 1000), (2, 1000)],
    ids=["0", "1", "2", "3", "0-one-bucket", "1-one-bucket", "2-one-bucket"],
)
def test_a_parameter_used_by_some_micro_steps_and_ranks_matches_pytorch(
    stage: int, bucket_numel: int
) -> None:
    want = _reference()
    for got in run_distributed(_body, world_size=WORLD, args=(stage, bucket_numel), timeout_s=120):
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-6, msg=name)
