"""MixedPrecision's DeepSpeed translation and the dynamic loss scale's rules (DeepSpeed >= 0.17.1),
and an overflow at the minimum scale raising on every rank."""

from __future__ import annotations

import pytest
import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero import LossScaler, MixedPrecision


def _precision(ds: dict) -> MixedPrecision:
    """The three precision sections of a ds_config, as the engine hands them over."""
    return MixedPrecision.from_sections(ds.get("fp16"), ds.get("bf16"), ds.get("data_types"))


def test_fp16_section_translates() -> None:
    prec = _precision(
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 12,
                "loss_scale_window": 50,
                "hysteresis": 3,
                "consecutive_hysteresis": True,
                "min_loss_scale": 4,
            },
            "data_types": {"grad_accum_dtype": "fp16"},
        }
    )
    assert prec == MixedPrecision(
        param_dtype=torch.float16,
        grad_accum_dtype=torch.float16,
        initial_scale_power=12,
        loss_scale_window=50,
        hysteresis=3,
        consecutive_hysteresis=True,
        min_loss_scale=4.0,
    )


def test_bf16_accumulates_in_fp32_unless_told_otherwise() -> None:
    assert _precision({"bf16": {"enabled": True}}).grad_accum_dtype == torch.float32
    prec = _precision({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}})
    assert prec.grad_accum_dtype == torch.bfloat16
    assert _precision({}).param_dtype == torch.float32


@pytest.mark.parametrize(
    "ds, match",
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "^bf16.enabled: .*at most one"),
        (
            {"fp16": {"enabled": True, "loss_scale_windw": 10}},
            r"fp16.loss_scale_windw: unknown key \(did you mean 'loss_scale_window'",
        ),
        (
            {"data_types": {"grad_accum_dtype": "int8"}},
            "^data_types.grad_accum_dtype: .*use one of",
        ),
        (
            {"data_types": {"grad_accum_dtype": "bf16"}},
            "^data_types.grad_accum_dtype: .*set grad_accum_dtype=torch.float32",
        ),
        (
            {"fp16": {"enabled": True, "hysteresis": 0}},
            r"^fp16.hysteresis: must be >= 1 .*\(MixedPrecision.hysteresis\)",
        ),
        (
            {"fp16": {"enabled": True, "loss_scale": -2}},
            r"^fp16.loss_scale: must be > 0 .*got -2.0 \(MixedPrecision.static_loss_scale\)",
        ),
    ],
)
def test_bad_precision_config(ds, match) -> None:
    with pytest.raises(ValueError, match=match):
        _precision(ds)


def test_static_scale_only_for_fp16() -> None:
    with pytest.raises(ValueError, match="static_loss_scale only applies to fp16"):
        MixedPrecision(param_dtype=torch.bfloat16, static_loss_scale=128.0)
    scaler = LossScaler(MixedPrecision(param_dtype=torch.float16, static_loss_scale=128.0))
    scaler.update(overflow=True)
    assert scaler.scale == 128.0 and scaler.overflows == 1


def test_no_scaling_outside_fp16() -> None:
    scaler = LossScaler(MixedPrecision(param_dtype=torch.bfloat16))
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 1.0


def test_window_doubles_scale_after_clean_steps() -> None:
    scaler = LossScaler(
        MixedPrecision(param_dtype=torch.float16, initial_scale_power=4, loss_scale_window=3)
    )
    scales = []
    for _ in range(7):
        scaler.update(overflow=False)
        scales.append(scaler.scale)
    # DeepSpeed >= 0.17.1: a clean step preceded by c > 0 clean steps doubles when c % window == 0,
    # i.e. at the 4th clean step, then every 3rd (0.17.0 and minispeed before: at the 3rd).
    assert scales == [16, 16, 16, 32, 32, 32, 64]


def test_hysteresis_delays_the_decrease_and_min_scale_bounds_it() -> None:
    prec = MixedPrecision(
        param_dtype=torch.float16,
        initial_scale_power=3,
        hysteresis=2,
        min_loss_scale=2.0,
        raise_error_at_min_scale=False,
    )
    scaler = LossScaler(prec)
    seen = []
    for _ in range(5):
        scaler.update(overflow=True)
        seen.append(scaler.scale)
    # The first overflow spends the hysteresis budget; then each one halves, down to the minimum.
    assert seen == [8, 4, 2, 2, 2]


def test_overflow_at_the_minimum_scale_raises_by_default() -> None:
    prec = MixedPrecision(
        param_dtype=torch.float16, initial_scale_power=2, hysteresis=1, min_loss_scale=2.0
    )
    scaler = LossScaler(prec)
    scaler.update(overflow=True)  # 4 -> 2: lowering to the minimum is fine
    assert scaler.scale == 2
    with pytest.raises(FloatingPointError, match="raise_error_at_min_scale=False"):
        scaler.update(overflow=True)  # already at the minimum
    assert _precision(
        {"fp16": {"enabled": True, "raise_error_at_min_scale": False}}
    ) == MixedPrecision(param_dtype=torch.float16, raise_error_at_min_scale=False)


def test_overflow_restarts_the_window() -> None:
    prec = MixedPrecision(
        param_dtype=torch.float16, initial_scale_power=4, loss_scale_window=2, hysteresis=1
    )
    scaler = LossScaler(prec)
    scaler.update(overflow=False)
    scaler.update(overflow=True)  # 16 -> 8, and the clean-step count starts over
    scaler.update(overflow=False)
    scaler.update(overflow=False)
    assert scaler.scale == 8
    scaler.update(overflow=False)  # the third clean step after it follows 2 = one window
    assert scaler.scale == 16
    scaler.update(overflow=False)
    scaler.update(overflow=False)  # then every window
    assert scaler.scale == 32


def test_state_dict_round_trip() -> None:
    prec = MixedPrecision(param_dtype=torch.float16, initial_scale_power=5, hysteresis=3)
    a = LossScaler(prec)
    a.update(overflow=True)
    a.update(overflow=False)
    b = LossScaler(prec)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    with pytest.raises(KeyError, match="lacks"):
        b.load_state_dict({"scale": 2.0})


def _overflow_at_min_scale(rank: int, world_size: int, stage: int) -> str:
    """An inf in one gradient, on rank 1 only, while the scale is at its minimum."""
    model = make_model()
    precision = MixedPrecision(
        param_dtype=torch.float16, initial_scale_power=3, hysteresis=1, min_loss_scale=8.0
    )
    opt = zero.shard(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        zero.ZeroConfig(stage=stage, stage3_param_persistence_threshold_numel=0),
        precision,
    )
    if rank == 1:
        model.blocks[0].mlp[0].weight.register_hook(lambda g: g * float("inf"))
    x, y = rank_slice(make_batches(1, 4)[0], rank, world_size)
    opt.backward(model(x, y))
    try:
        opt.step()
    except FloatingPointError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("stage", [1, 3])
def test_overflow_at_the_minimum_scale_raises_on_every_rank(stage: int) -> None:
    for message in run_distributed(_overflow_at_min_scale, world_size=2, args=(stage,)):
        assert "minimum loss scale 8" in message and "raise_error_at_min_scale" in message
