"""Rules of the step, on 2 gloo ranks against plain PyTorch.

- Note [which optimizers can step a slice]: at stages 1-3 an optimizer not known to be
  elementwise is refused unless the caller vouches for it, because stepping a slice silently
  changes an update that reads other elements. Shown with a per-tensor normalized SGD
  (`p -= lr · g / ||g||`, the shape of LAMB's and LARS's trust ratio).
- `max_grad_norm = inf`: the norm is computed and the gradients are left as they are."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import minispeed.zero as zero
from minispeed.core.testing import run_distributed


class PlainSGD(torch.optim.Optimizer):
    """p -= lr · direction(g); here direction(g) = g, declared elementwise."""

    elementwise = True

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @staticmethod
    def direction(g: torch.Tensor) -> torch.Tensor:
        return g

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * self.direction(p.grad))


class NormalizedSGD(PlainSGD):
    """p -= lr · g / ||g||, the norm over the whole tensor: not elementwise."""

    elementwise = False

    @staticmethod
    def direction(g: torch.Tensor) -> torch.Tensor:
        return g / g.norm().clamp_min(1e-12)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _data(rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))


def _train(model: nn.Module, opt, data: list[torch.Tensor], backward) -> list[float]:
    """Three steps on the mean loss over `data`; each parameter's sum after them."""
    for _ in range(3):
        backward(sum(model(x).pow(2).mean() for x in data) / len(data))
        opt.step()
        opt.zero_grad()
    return [float(p.detach().sum()) for p in model.parameters()]


def _plain(kind: type, lr: float = 0.1) -> list[float]:
    model = _model()
    opt = kind(model.parameters(), lr=lr)
    return _train(model, opt, [_data(0), _data(1)], lambda loss: loss.backward())


def _sharded(rank: int, world_size: int, kind: type, stage: int, allow: bool) -> object:
    model = _model()
    try:
        opt = zero.shard(
            model,
            kind(model.parameters(), lr=0.1),
            zero.ZeroConfig(stage=stage),
            allow_untested_optimizer=allow,
        )
    except TypeError as err:
        return str(err)
    with opt:
        return _train(model, opt, [_data(rank)], opt.backward)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_an_optimizer_not_known_elementwise_is_refused_at_stages_1_3(stage):
    for msg in run_distributed(
        _sharded, world_size=2, args=(NormalizedSGD, stage, False), timeout_s=120
    ):
        assert "NormalizedSGD is not known to update each element independently" in msg
        assert "allow_untested_optimizer=True" in msg and "zero_allow_untested_optimizer" in msg


def test_the_refusal_guards_a_real_difference_and_stage_0_has_none():
    """Vouched for wrongly at stage 2, the per-tensor norm is taken over each slice and the
    weights leave plain PyTorch's; at stage 0 (whole parameters) they match it."""
    plain = _plain(NormalizedSGD)
    forced = run_distributed(_sharded, world_size=2, args=(NormalizedSGD, 2, True), timeout_s=120)
    assert forced[0] != pytest.approx(plain, rel=1e-4)
    whole = run_distributed(_sharded, world_size=2, args=(NormalizedSGD, 0, False), timeout_s=120)
    assert whole[0] == pytest.approx(plain, rel=1e-5)


def test_a_class_that_declares_itself_elementwise_is_accepted():
    got = run_distributed(_sharded, world_size=2, args=(PlainSGD, 2, False), timeout_s=120)
    assert got[0] == pytest.approx(_plain(PlainSGD), rel=1e-5)


def _norm_only(rank: int, world_size: int, clip: float) -> tuple:
    model = _model()
    opt = zero.shard(
        model,
        torch.optim.SGD(model.parameters(), lr=10.0),  # large steps: a clip would show
        zero.ZeroConfig(stage=2, max_grad_norm=clip),
    )
    with opt:
        sums = _train(model, opt, [_data(rank)], opt.backward)
        return sums, opt.global_grad_norm


class _TwoParams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.ones(3))
        self.b = nn.Parameter(torch.arange(3.0))


def _overflow(rank: int, world_size: int) -> tuple:
    model = _TwoParams()
    opt = zero.shard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        zero.ZeroConfig(stage=0, max_grad_norm=math.inf),
    )
    with opt:
        # a's gradient overflows fp32 (1e60); b's is 2b
        opt.backward((model.a * 1e30).sum() * 1e30 + model.b.pow(2).sum())
        opt.step()
        return model.b.detach().tolist(), opt.global_grad_norm


def test_the_norm_alone_leaves_an_overflowed_gradient_to_its_own_parameter():
    """An infinite norm does not reach the other gradients (min(1, inf / inf) would be NaN):
    b steps as plain SGD steps it, as DeepSpeed steps without clipping. Stage 0 in fp32, the one
    place where such a step is taken at all (DeepSpeed's stages 1-3 skip it: LossScaler.checks)."""
    for b, norm in run_distributed(_overflow, world_size=2, timeout_s=120):
        assert norm == math.inf
        assert b == pytest.approx([0.0, 0.8, 1.6])


def test_an_infinite_clipping_threshold_gives_the_norm_and_leaves_the_gradients():
    """ZeroConfig.max_grad_norm = inf (the engine's `gradient_clipping` 0 where DeepSpeed still
    reports a norm): the norm of the last step, and the weights of no clipping at all."""
    plain = _plain(torch.optim.SGD, lr=10.0)
    for (sums, norm), (unclipped, none) in zip(
        run_distributed(_norm_only, world_size=2, args=(math.inf,), timeout_s=120),
        run_distributed(_norm_only, world_size=2, args=(0.0,), timeout_s=120),
        strict=True,
    ):
        assert none is None and norm is not None and norm > 0
        assert sums == unclipped == pytest.approx(plain, rel=1e-5)
