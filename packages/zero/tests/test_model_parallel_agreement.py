"""`zero.shard(..., model_parallel=zero.ModelParallel(...))`: the gradient norm, the fp16
overflow verdict and tied gradients reduced over the grid's other axes, not one part's.

4 ranks as a 2 × 2 grid: data groups {0, 1} and {2, 3} (ZeRO partitions over them), "part"
groups {0, 2} and {1, 3} (the other axis). Part 0 holds `a` and its copy of the tied `w`, part
1 holds `b` and its copy of `w`; the whole model's loss is the sum of the parts' losses, so
each part's gradient is the whole model's for its parameters, and `w`'s is the sum of both
parts'. The reference is one process holding `a`, `b` and one `w`, clipped with
`torch.nn.utils.clip_grad_norm_` over all three. Then: an fp16 overflow on one rank of one part
skips the step on every rank, and a step error found on one part raises on every rank.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.testing import run_distributed

STEPS, GAS, MICRO, WIDTH, CLIP = 3, 2, 4, 5, 0.05


class Part(nn.Module):
    def __init__(self, part: int) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH))  # tied: the same start on both parts
        torch.manual_seed(11 + part)
        self.own = nn.Parameter(torch.randn(WIDTH + 2 * part, WIDTH))  # odd sizes: padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, WIDTH)
        return ((x @ self.w) @ self.own.t()).pow(2).mean()


def _batches(step: int, replica: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + replica)
    return [torch.randn(MICRO, WIDTH, generator=g) for _ in range(GAS)]


def _grid() -> tuple[int, int, object, object]:
    rank = comm.get_rank()
    part, replica = rank // 2, rank % 2
    data = [comm.new_group([0, 1]), comm.new_group([2, 3])][part]
    other = [comm.new_group([0, 2]), comm.new_group([1, 3])][replica]
    return part, replica, data, other


def _train(rank: int, world_size: int, stage: int, tied: bool) -> dict:
    part, replica, data, other = _grid()
    model = Part(part)
    opt = zero.shard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        zero.ZeroConfig(stage=stage, gradient_accumulation_steps=GAS, max_grad_norm=CLIP),
        group=data,
        model_parallel=zero.ModelParallel(
            groups=(other,),
            shared=((model.w, other),) if tied else (),
            counted_elsewhere=(model.w,) if tied and part == 1 else (),
        ),
    )
    norms = []
    for step in range(STEPS):
        for x in _batches(step, replica):
            opt.backward(model(x))  # ZeRO takes the mean over the 2 replicas and GAS
            opt.step()
        norms.append(opt.global_grad_norm)
    return {"w": model.w.detach().clone(), "own": model.own.detach().clone(), "norms": norms}


def _reference(tied: bool) -> dict:
    parts = [Part(0), Part(1)]
    if tied:
        parts[1].w = parts[0].w
    params = list({id(p): p for m in parts for p in m.parameters()}.values())
    opt = torch.optim.SGD(params, lr=0.1)
    norms = []
    for step in range(STEPS):
        for replica in range(2):
            for x in _batches(step, replica):
                (sum(m(x) for m in parts) / (2 * GAS)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        opt.zero_grad()
    return {"w": [m.w.detach() for m in parts], "own": [m.own.detach() for m in parts],
            "norms": norms}  # fmt: skip


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_norm_and_tied_grads_span_the_grid(stage: int, tied: bool) -> None:
    want = _reference(tied)
    assert want["norms"][0] > 5 * CLIP  # clipping bites
    for rank, got in enumerate(run_distributed(_train, world_size=4, args=(stage, tied))):
        part = rank // 2
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)
        torch.testing.assert_close(got["w"], want["w"][part], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["own"], want["own"][part], rtol=1e-5, atol=1e-6)


def _overflow(rank: int, world_size: int) -> dict:
    part, replica, data, other = _grid()
    model = Part(part)
    opt = zero.shard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        zero.ZeroConfig(stage=2),
        precision=zero.MixedPrecision(
            param_dtype=torch.float16, initial_scale_power=4, hysteresis=1
        ),
        group=data,
        model_parallel=zero.ModelParallel(groups=(other,)),
    )
    x = _batches(0, replica)[0].half()
    opt.backward(model(x))
    stepped = opt.step()  # a clean step first: the scale is small enough for these gradients
    if rank == 3:  # one rank of one part only
        x[0, 0] = float("inf")
    before = model.own.detach().clone()
    opt.backward(model(x))
    overflowed = not opt.step()
    return {
        "first_stepped": stepped,
        "overflowed": overflowed,
        "scale": opt.loss_scaler.scale,
        "unchanged": bool(torch.equal(model.own.detach(), before)),
    }


def test_fp16_overflow_on_one_part_skips_the_step_on_every_rank() -> None:
    for got in run_distributed(_overflow, world_size=4):
        assert got == {"first_stepped": True, "overflowed": True, "scale": 8.0, "unchanged": True}


def _foreign(rank: int, world_size: int) -> str:
    model, other = Part(0), nn.Parameter(torch.ones(2))
    try:
        zero.ModelParallel(counted_elsewhere=(other,)).check(list(model.parameters()))
    except ValueError as exc:
        return str(exc)
    return ""


def test_a_parameter_zero_does_not_manage_is_refused() -> None:
    assert "not a parameter of the optimizer" in _foreign(0, 1)


def _unfrozen_on_one_part(rank: int, world_size: int) -> str:
    part, replica, data, other = _grid()
    model = Part(part)
    model.own.requires_grad_(False)  # frozen when shard() builds the hooks
    opt = zero.shard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        group=data,
        model_parallel=zero.ModelParallel(groups=(other,)),
    )
    if part == 1:
        model.own.requires_grad_(True)  # no hook, no buffer: the step must refuse it
    opt.backward(model(_batches(0, replica)[0]))
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return "stepped"


def test_a_step_error_on_one_part_raises_on_every_rank() -> None:
    got = run_distributed(_unfrozen_on_one_part, world_size=4)
    assert all("'own' was frozen" in msg for msg in got[2:])  # the part that found it
    assert all("failed on another rank" in msg for msg in got[:2])  # and the other part
