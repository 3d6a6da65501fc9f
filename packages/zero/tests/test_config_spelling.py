"""A misspelled ds_config section or key fails with a did-you-mean instead of being ignored, in the
packages' deprecated whole-config readers too (the engine's `EngineConfig` checks every top-level
key itself: tests/engine/test_engine_config.py).

Before: ``{"zero_optimisation": {"stage": 2}}`` trained at stage 0 and
``"gradient_acumulation_steps"`` left accumulation at 1, silently (issue 14, item 8).
"""

from __future__ import annotations

import pytest
import torch

from minispeed.core.config import edit_distance
from minispeed.zero import MixedPrecision, ZeroConfig


@pytest.mark.parametrize(
    "ds, meant",
    [
        ({"zero_optimisation": {"stage": 2}}, "zero_optimization"),
        ({"Zero_Optimization": {"stage": 2}}, "zero_optimization"),
        ({"gradient_acumulation_steps": 4}, "gradient_accumulation_steps"),
        ({"gradient_cliping": 1.0}, "gradient_clipping"),
        ({"zero_optimization": {"stage": 2, "reduce_bucket_sise": 10}}, "reduce_bucket_size"),
    ],
)
def test_zero_config_names_the_key_it_meant(ds, meant) -> None:
    with pytest.raises(ValueError, match=f"did you mean '{meant}'"), pytest.deprecated_call():
        ZeroConfig.from_ds_config(ds)


@pytest.mark.parametrize(
    "ds, meant",
    [
        ({"fp_16": {"enabled": True}}, "fp16"),
        ({"bf61": {"enabled": True}}, "bf16"),
        ({"data_type": {"grad_accum_dtype": "fp32"}}, "data_types"),
        ({"fp16": {"enabled": True, "min_los_scale": 2}}, "min_loss_scale"),
    ],
)
def test_mixed_precision_names_the_key_it_meant(ds, meant) -> None:
    with pytest.raises(ValueError, match=f"did you mean '{meant}'"), pytest.deprecated_call():
        MixedPrecision.from_ds_config(ds)


def test_other_packages_sections_and_far_keys_pass() -> None:
    ds = {
        "train_batch_size": 8,
        "optimizer": {"type": "AdamW"},
        "bf16": {"enabled": True},
        "amp": {"enabled": False},
        "my_own_notes": "x",
        "zero_optimization": {"stage": 2},
        "gradient_accumulation_steps": 2,
    }
    with pytest.deprecated_call():
        assert ZeroConfig.from_ds_config(ds) == ZeroConfig(
            stage=2, gradient_accumulation_steps=2, overlap_comm=False
        )
        assert MixedPrecision.from_ds_config(ds).param_dtype == torch.bfloat16


def test_old_bf16_section_name_is_read() -> None:
    with pytest.deprecated_call():
        old = MixedPrecision.from_ds_config({"bfloat16": {"enabled": True}})
    assert old.param_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="keep only 'bf16'"), pytest.deprecated_call():
        MixedPrecision.from_ds_config({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})


def test_edit_distance_counts_a_swap_once() -> None:
    assert edit_distance("optimisation", "optimization") == 1
    assert edit_distance("fp61", "fp16") == 1
    assert edit_distance("fp32", "fp16") == 2
    assert edit_distance("", "abc") == 3
