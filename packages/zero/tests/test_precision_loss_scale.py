"""MixedPrecision's DeepSpeed translation and the dynamic loss scale's rules (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from minispeed.zero import LossScaler, MixedPrecision


def test_fp16_section_translates() -> None:
    prec = MixedPrecision.from_ds_config(
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
    assert (
        MixedPrecision.from_ds_config({"bf16": {"enabled": True}}).grad_accum_dtype == torch.float32
    )
    prec = MixedPrecision.from_ds_config(
        {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}
    )
    assert prec.grad_accum_dtype == torch.bfloat16
    assert MixedPrecision.from_ds_config({}).param_dtype == torch.float32


@pytest.mark.parametrize(
    "ds, match",
    [
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "enable at most one"),
        (
            {"fp16": {"enabled": True, "loss_scale_windw": 10}},
            r"unknown fp16 key\(s\) \['loss_scale_windw'\]",
        ),
        ({"data_types": {"grad_accum_dtype": "int8"}}, "use one of"),
        ({"data_types": {"grad_accum_dtype": "bf16"}}, "set grad_accum_dtype=torch.float32"),
        ({"fp16": {"enabled": True, "hysteresis": 0}}, "hysteresis must be >= 1"),
    ],
)
def test_bad_precision_config(ds, match) -> None:
    with pytest.raises(ValueError, match=match):
        MixedPrecision.from_ds_config(ds)


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
    assert scales == [16, 16, 32, 32, 32, 64, 64]


def test_hysteresis_delays_the_decrease_and_min_scale_bounds_it() -> None:
    prec = MixedPrecision(
        param_dtype=torch.float16, initial_scale_power=3, hysteresis=2, min_loss_scale=2.0
    )
    scaler = LossScaler(prec)
    seen = []
    for _ in range(5):
        scaler.update(overflow=True)
        seen.append(scaler.scale)
    # The first overflow spends the hysteresis budget; then each one halves, down to the minimum.
    assert seen == [8, 4, 2, 2, 2]


def test_overflow_restarts_the_window() -> None:
    prec = MixedPrecision(
        param_dtype=torch.float16, initial_scale_power=4, loss_scale_window=2, hysteresis=1
    )
    scaler = LossScaler(prec)
    scaler.update(overflow=False)
    scaler.update(overflow=True)  # 16 -> 8, and the clean-step count starts over
    scaler.update(overflow=False)
    assert scaler.scale == 8
    scaler.update(overflow=False)
    assert scaler.scale == 16


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
