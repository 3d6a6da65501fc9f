"""``ZeroConfig.from_section``: DeepSpeed keys in, clearly named typed fields out, bad keys refused
with the key as written."""

from __future__ import annotations

import pytest

from minispeed.core.config import ConfigError
from minispeed.zero import ZeroConfig


def test_deepspeed_keys_map_to_named_fields() -> None:
    cfg = ZeroConfig.from_section(
        {
            "stage": 2,
            "reduce_bucket_size": 5e7,  # DeepSpeed files write sizes as floats
            "allgather_bucket_size": 2e8,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": False,
            "ignore_unused_parameters": False,
            "stage3_prefetch_bucket_size": 123,
            "stage3_param_persistence_threshold": 456,
            "stage3_max_live_parameters": 789,
            "stage3_max_reuse_distance": 1011,
            "stage3_gather_16bit_weights_on_model_save": True,
            "sub_group_size": 1213,
        },
        gradient_accumulation_steps=4,
        max_grad_norm=1.0,
    )
    assert cfg == ZeroConfig(
        stage=2,
        reduce_bucket_numel=50_000_000,
        allgather_bucket_numel=200_000_000,
        overlap_comm=True,
        contiguous_gradients=True,
        reduce_scatter=False,
        ignore_unused_parameters=False,
        gradient_accumulation_steps=4,
        max_grad_norm=1.0,
        stage3_prefetch_bucket_numel=123,
        stage3_param_persistence_threshold_numel=456,
        stage3_max_live_numel=789,
        stage3_max_reuse_distance_numel=1011,
        stage3_gather_16bit_weights_on_model_save=True,
        sub_group_numel=1213,
    )
    assert isinstance(cfg.reduce_bucket_numel, int)


def test_missing_section_is_stage_0_and_overlap_default_is_off_only_where_it_costs() -> None:
    # Note [overlap_comm's default]: off by default only at stage 2, whose in-flight staging
    # buckets cost memory (DeepSpeed's reason); written out, the key wins at every stage.
    assert ZeroConfig.from_section(None).stage == 0
    defaults = {stage: ZeroConfig.from_section({"stage": stage}).overlap_comm for stage in range(4)}
    assert defaults == {0: True, 1: True, 2: False, 3: True}
    for stage in range(4):
        for value in (True, False):
            section = {"stage": stage, "overlap_comm": value}
            assert ZeroConfig.from_section(section).overlap_comm is value


def test_old_spelling_of_gather_on_save_is_accepted_but_not_contradicted() -> None:
    old = {"stage3_gather_fp16_weights_on_model_save": True}
    assert ZeroConfig.from_section(old).stage3_gather_16bit_weights_on_model_save
    both = {**old, "stage3_gather_16bit_weights_on_model_save": False}
    with pytest.raises(
        ValueError,
        match=r"zero_optimization.stage3_gather_fp16_weights_on_model_save: another name of "
        "'stage3_gather_16bit_weights_on_model_save', which is also set, differently; keep only",
    ):
        ZeroConfig.from_section(both)


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"zero_optimization.reduce_bucket: unknown key") as err:
        ZeroConfig.from_section({"stage": 1, "reduce_bucket": 10})
    assert err.value.path == "zero_optimization.reduce_bucket"


def test_zero_section_alone_equals_the_whole_config() -> None:
    """The engine hands ZeRO its own section plus the three values it needs from elsewhere; the
    deprecated whole-config reader picks the same ones."""
    section = {"stage": 2, "reduce_bucket_size": 5e7}
    whole = {
        "zero_optimization": section,
        "gradient_accumulation_steps": 4.0,
        "gradient_clipping": 1,
    }
    got = ZeroConfig.from_section(section, gradient_accumulation_steps=4, max_grad_norm=1.0)
    with pytest.deprecated_call():
        assert got == ZeroConfig.from_ds_config(whole)
    assert (got.reduce_bucket_numel, got.max_grad_norm) == (50_000_000, 1.0)


@pytest.mark.parametrize(
    "section, match",
    [
        (
            {"allgather_partitions": False},
            "zero_optimization.allgather_partitions: DeepSpeed's 'allgather_partitions' is not "
            "supported.*true is accepted",
        ),
        (
            {"stage": 4},
            r"zero_optimization.stage: must be 0, 1, 2 or 3, got 4 \(ZeroConfig.stage\)",
        ),
        ({"stage": "2"}, "zero_optimization.stage: must be an integer, got '2'"),
        ({"overlap_comm": 1}, "zero_optimization.overlap_comm: must be true or false, got 1"),
        (
            {"allgather_bucket_size": -5},
            r"zero_optimization.allgather_bucket_size: must be >= 1, got -5.*"
            r"\(ZeroConfig.allgather_bucket_numel\)",
        ),
    ],
)
def test_contradictory_or_unsupported_values(section, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        ZeroConfig.from_section(section)


def test_offload_to_none_is_accepted() -> None:
    cfg = ZeroConfig.from_section({"stage": 2, "offload_optimizer": {"device": "none"}})
    assert cfg.stage == 2 and cfg.offload_optimizer is None


def test_values_from_elsewhere_are_validated() -> None:
    with pytest.raises(ValueError, match=r"ZeroConfig.gradient_accumulation_steps: must be >= 1"):
        ZeroConfig.from_section(None, gradient_accumulation_steps=0)
    with pytest.raises(ValueError, match=r"ZeroConfig.max_grad_norm: must be >= 0"):
        ZeroConfig.from_section(None, max_grad_norm=-1.0)
