"""``requires_grad`` changed after ``zero.shard()`` (issue 14, item 3).

Unfreezing: a parameter frozen when ``shard()`` ran has no gradient hook or buffer. Set
``requires_grad=True`` later, it used to be silently never trained; now the first step that sees
it raises on every rank, naming it and the fix (Note [requires_grad is fixed at shard time] in
optimizer.py), even when only one rank unfroze it.

Freezing: a trained parameter set ``requires_grad=False`` later gets no gradient; PyTorch's
optimizer then skips it (``grad is None``: no decay, no moment update, no step count). ZeRO does
the same, at every stage, exactly, and does not count it as an unused parameter.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

STEPS, FREEZE_AT, WORLD = 5, 2, 2


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _config(stage: int, **kw) -> zero.ZeroConfig:
    return zero.ZeroConfig(stage=stage, stage3_param_persistence_threshold_numel=0, **kw)


def _unfreeze_body(rank: int, world_size: int, stage: int, only_rank: int | None) -> str:
    model = Model()
    model.a.weight.requires_grad_(False)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=0.01), _config(stage))
    opt.backward(model(_data(0, rank)))
    assert opt.step()
    if only_rank is None or rank == only_rank:
        model.a.weight.requires_grad_(True)
    opt.backward(model(_data(1, rank)))
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_unfreezing_after_shard_raises_on_every_rank(stage: int) -> None:
    for message in run_distributed(_unfreeze_body, world_size=WORLD, args=(stage, None)):
        assert "'a.weight' was frozen" in message and "re-shard" in message, message


@pytest.mark.parametrize("stage", [0, 2])  # 0: the verdict rides with the gradients
def test_unfreezing_on_one_rank_only_raises_on_every_rank(stage: int) -> None:
    for message in run_distributed(_unfreeze_body, world_size=WORLD, args=(stage, 1)):
        assert "'a.weight' was frozen" in message, message


def _reference() -> dict[str, torch.Tensor]:
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for s in range(STEPS):
        if s == FREEZE_AT:
            model.a.bias.requires_grad_(False)
        (sum(model(_data(s, r)) for r in range(WORLD)) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _freeze_body(rank: int, world_size: int, stage: int) -> dict[str, torch.Tensor]:
    model = Model()
    opt = zero.shard(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1),
        _config(stage, ignore_unused_parameters=False),
    )
    for s in range(STEPS):
        if s == FREEZE_AT:
            model.a.bias.requires_grad_(False)
        opt.backward(model(_data(s, rank)))
        assert opt.step()
    if stage == 3:
        with zero.GatheredParameters(list(model.parameters())):
            return {k: v.detach().clone() for k, v in model.named_parameters()}
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_freezing_after_shard_skips_the_parameter_like_pytorch(stage: int) -> None:
    want = _reference()
    for got in run_distributed(_freeze_body, world_size=WORLD, args=(stage,)):
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-7, msg=name)
