"""The engine's ds_config: the batch triple as DeepSpeed derives it, every key checked, clear errors."""

from __future__ import annotations

import json

import pytest

from minispeed.core.config import DEEPSPEED_TOP_LEVEL, ConfigError
from minispeed.engine.config import READ, UNSUPPORTED, EngineConfig, load_ds_config, resolve_batch


@pytest.mark.parametrize(
    ("given", "n", "expected"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 1, (32, 4, 8)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 16}, 4, (16, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 2}, 4, (8, 2, 1)),
        (
            {
                "train_batch_size": 24,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 3,
            },
            2,
            (24, 4, 3),
        ),
        (
            {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4},
            2,
            (8, 4, 1),
        ),
    ],
)
def test_batch_triple_derives_like_deepspeed(given, n, expected) -> None:
    assert resolve_batch(given, n) == expected


@pytest.mark.parametrize(
    "given",
    [
        {
            "train_batch_size": 30,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
        },
        {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},  # 30 / 4 / 2 rounds down
        {"gradient_accumulation_steps": 2},
        {},
        {"train_micro_batch_size_per_gpu": 0},
        {"train_micro_batch_size_per_gpu": 2.5},
    ],
)
def test_batch_triple_that_does_not_multiply_out_is_refused(given) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_batch(given, 2)
    assert e.value.path in ("train_batch_size", "train_micro_batch_size_per_gpu")


def test_sections_reach_their_packages() -> None:
    cfg = EngineConfig.from_ds_config(
        {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_clipping": 0.5,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e5},
            "bf16": {"enabled": True},
            "steps_per_print": 10,
            "wall_clock_breakdown": True,
            "comms_logger": {"enabled": True},
        },
        data_parallel_size=2,
    )
    assert cfg.gradient_accumulation_steps == 4
    assert cfg.zero.stage == 2 and cfg.zero.gradient_accumulation_steps == 4
    assert cfg.zero.max_grad_norm == 0.5 and cfg.zero.reduce_bucket_numel == 500_000
    assert str(cfg.precision.param_dtype) == "torch.bfloat16"
    assert cfg.steps_per_print == 10 and cfg.wall_clock_breakdown
    assert cfg.comms_logger.enabled and not cfg.flops_profiler.enabled


@pytest.mark.parametrize(
    ("ds", "path", "words"),
    [
        (
            {"zero_optimisation": {"stage": 1}},
            "zero_optimisation",
            "did you mean 'zero_optimization'",
        ),
        (
            {"gradient_acumulation_steps": 2},
            "gradient_acumulation_steps",
            "gradient_accumulation_steps",
        ),
        ({"eigenvalue": {"enabled": True}}, "eigenvalue", "not supported"),
        ({"prescale_gradients": True}, "prescale_gradients", "not supported"),
        ({"comms_logger": {"enabeld": True}}, "comms_logger.enabeld", "did you mean 'enabled'"),
        ({"optimizer": {"type": "AdamW", "parms": {}}}, "optimizer.parms", "did you mean 'params'"),
        ({"optimizer": {"params": {}}}, "optimizer.type", "by name"),
        ({"zero_optimization": {"stgae": 2}}, "zero_optimization.stgae", "did you mean 'stage'"),
        ({"fp16": {"enabled": True, "los_scale": 0}}, "fp16.los_scale", "'loss_scale'"),
        ({"pipeline": {"stagez": 2}}, "pipeline.stagez", "did you mean 'stages'"),
        (  # a key three levels deep keeps its parents (issue 32 point 7)
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"pin_memroy": True}}},
            "zero_optimization.offload_optimizer.pin_memroy",
            "did you mean 'pin_memory'",
        ),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"devise": "cpu"}}},
            "zero_optimization.offload_optimizer.devise",
            "did you mean 'device'",
        ),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "bf16.enabled", "at most one"),
        (
            {"tensor_parallel": {"autotp_size": -2}},
            "tensor_parallel.autotp_size",
            "must be an integer >= 0",
        ),
        ({"tensor_parallel": {"autotp_sise": 2}}, "tensor_parallel.autotp_sise", "'autotp_size'"),
        ({"communication_data_type": "fp16"}, "communication_data_type", "grad_accum_dtype"),
        (
            {"activation_checkpointing": {"contiguous_memory_optimization": 1}},
            "activation_checkpointing.contiguous_memory_optimization",
            "false or true are accepted",
        ),
        ({"pipeline": {"stages": "auto"}}, "pipeline.stages", "PipelineModule"),
    ],
)
def test_bad_keys_are_named(ds, path, words) -> None:
    ds = {"train_micro_batch_size_per_gpu": 1, **ds}
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_ds_config(ds)
    assert e.value.path == path
    assert words in str(e.value)


def test_deepspeed_defaults_of_unsupported_keys_are_accepted() -> None:
    """A config written out in full, with DeepSpeed's defaults for what we lack, loads."""
    EngineConfig.from_ds_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "prescale_gradients": False,
            "gradient_predivide_factor": 1.0,
            "tensorboard": {"enabled": False},
            "wandb": {"enabled": False},
            "memory_breakdown": False,
            "tensor_parallel": {"autotp_size": 0},
            "activation_checkpointing": {
                "partition_activations": False,
                "cpu_checkpointing": False,
            },
            "checkpoint": {"use_node_local_storage": False},
            "communication_data_type": "fp32",
        }
    )


def test_config_that_is_not_json_names_line_and_column(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2,}\n}\n')
    with pytest.raises(ConfigError, match=r"line 3, column 36"):
        load_ds_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_ds_config(tmp_path / "missing.json")
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="JSON object"):
        load_ds_config(path)


def test_a_key_given_twice_is_refused_by_its_path(tmp_path) -> None:
    """JSON parsers keep the last of two equal keys silently; DeepSpeed refuses them."""
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}')
    assert load_ds_config(path)["zero_optimization"]["stage"] == 1
    path.write_text('{"zero_optimization": {"stage": 1, "stage": 3}}')
    with pytest.raises(
        ConfigError, match=r"^zero_optimization.stage: is given 2 times .*\(1, then 3\)"
    ):
        load_ds_config(path)
    path.write_text('{"a": [{"b": {"c": 1, "c": 1}}]}')
    with pytest.raises(ConfigError, match=r"^a\[0\].b.c: is given 2 times"):
        load_ds_config(path)


def test_every_deepspeed_top_level_key_is_read_or_refused_with_a_reason() -> None:
    """The one catalogue of DeepSpeed's top-level keys (core) and the engine's tables agree, so
    the migration page's list is complete: each key is either read or refused with its reason.
    READ is core's catalogue less the refused keys, so a key added to core without a reason is
    read here: the list below is the keys the engine really hands to its code."""
    assert UNSUPPORTED.keys() <= DEEPSPEED_TOP_LEVEL
    assert {
        "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
        "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "data_types", "torch_autocast",
        "zero_optimization", "gradient_clipping", "aio", "steps_per_print", "wall_clock_breakdown", "comms_logger",
        "flops_profiler", "activation_checkpointing", "pipeline", "checkpoint",
        "communication_data_type", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
        "tensor_parallel", "sequence_parallel_size", "compression_training",
        "progressive_layer_drop", "curriculum_learning", "elasticity",
        "tensorboard", "wandb", "csv_monitor", "comet",
    } == READ  # fmt: skip


def test_config_error_is_a_value_error_carrying_the_path() -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig.from_ds_config({"train_micro_batch_size_per_gpu": 1, "steps_per_print": "10"})
    assert isinstance(e.value, ConfigError) and e.value.path == "steps_per_print"


def test_the_pipeline_section_is_read_once_with_one_rule() -> None:
    """`stages` left out or "auto" is the PipelineModule's count; an int must equal it (the rule
    `EngineConfig` and the pipeline engine share; "auto" was once accepted by one and refused
    by the other)."""
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4}
    for section in ({}, {"stages": "auto"}, {"stages": 2}):
        cfg = EngineConfig.from_ds_config({**ds, "pipeline": section}, pipeline_stages=2)
        assert (cfg.pipeline.stages, cfg.pipeline.schedule) == (2, "1f1b")
    assert EngineConfig.from_ds_config(ds, pipeline_stages=8).pipeline.schedule == "gpipe"
    with pytest.raises(ConfigError, match=r"^pipeline.stages: 3 but the PipelineModule has 2"):
        EngineConfig.from_ds_config({**ds, "pipeline": {"stages": 3}}, pipeline_stages=2)
    assert EngineConfig.from_ds_config(ds).pipeline is None  # no section, no pipeline


def test_gradient_clipping_defaults_to_deepspeeds_one() -> None:
    """DeepSpeed 0.19.8 clips at 1.0 when the key is left out; 0 written out turns it off."""
    assert EngineConfig.from_ds_config({"train_batch_size": 2}).zero.max_grad_norm == 1.0
    off = EngineConfig.from_ds_config({"train_batch_size": 2, "gradient_clipping": 0.0})
    assert off.zero.max_grad_norm == 0.0


def test_hugging_face_auto_batch_sizes_name_who_fills_them() -> None:
    """A Trainer-style config handed to initialize() directly: "auto" is named as the cause."""
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    with pytest.raises(ConfigError, match="filled in by Hugging Face's Trainer") as err:
        resolve_batch({**ds, "gradient_accumulation_steps": "auto"}, 2)
    assert err.value.path == "train_batch_size"
    assert resolve_batch({**ds, "train_micro_batch_size_per_gpu": 4}, 2) == (8, 4, 1)


def test_auto_in_deepspeeds_model_sections_is_the_default() -> None:
    """A Hugging Face config not yet filled by the Trainer (TRL prepares its reference model
    from one): `"auto"` in zero_optimization, its offload sections, fp16 and bf16 is the key's
    default, as DeepSpeed's pydantic models read it; the same config without them is equal."""
    filled = {
        "train_batch_size": 4,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}},
    }
    auto = {
        "train_batch_size": 4,
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto", "loss_scale": "auto"},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "overlap_comm": "auto",
            "offload_optimizer": {"device": "none", "pin_memory": "auto"},
        },
    }
    a, b = EngineConfig.from_ds_config(auto), EngineConfig.from_ds_config(filled)
    assert (a.zero, a.precision) == (b.zero, b.precision)
    with pytest.raises(ConfigError, match=r"^activation_checkpointing\.partition_activations"):
        EngineConfig.from_ds_config(  # not one of DeepSpeed's pydantic sections: a bad value
            {**filled, "activation_checkpointing": {"partition_activations": "auto"}}
        )


def test_a_dotted_path_at_the_top_level_is_ignored_as_deepspeed_does(caplog) -> None:
    """TRL adds `"zero_optimization.reduce_bucket_size"` at the top level; DeepSpeed reads nested
    sections only, so the key changes nothing there: here too, with a warning naming the nested
    form. A dotted key into no known section is still an unknown key."""
    base = {"train_batch_size": 4, "zero_optimization": {"stage": 3}}
    dotted = {**base, "zero_optimization.stage3_prefetch_bucket_size": 128.0}
    with caplog.at_level("WARNING"):
        cfg = EngineConfig.from_ds_config(dotted)
    assert cfg.zero == EngineConfig.from_ds_config(base).zero
    assert '{"zero_optimization": {"stage3_prefetch_bucket_size": ...}}' in caplog.text
    with pytest.raises(ConfigError, match=r"zero_optimisation\.stage: unknown key"):
        EngineConfig.from_ds_config({**base, "zero_optimisation.stage": 3})


# axolotl's zero3_bf16.json (bf16 off on the CPU): every stage-3 count 0, DeepSpeed's "none"
AXOLOTL_ZEROS = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "sub_group_size": 0,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 0,
    "stage3_max_reuse_distance": 0,
    "stage3_gather_16bit_weights_on_model_save": True,
}


def _zeros_steps(rank: int, world_size: int, zero: dict) -> list[float]:
    import torch

    import minispeed.engine as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_batch_size": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": zero,
        },
    )
    losses = []
    for step in range(3):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_zero_counts_of_deepspeeds_configs_train_as_the_defaults() -> None:
    """`0` for the prefetch bucket, live parameters, reuse distance, persistence threshold and
    sub-group size is DeepSpeed's "none" (axolotl ships it): accepted, and the same steps as the
    defaults (they change what is kept gathered and when, never a value)."""
    from minispeed.core.testing import run_distributed

    zeros = run_distributed(_zeros_steps, world_size=2, args=(AXOLOTL_ZEROS,), timeout_s=120)
    plain = run_distributed(_zeros_steps, world_size=2, args=({"stage": 3},), timeout_s=120)
    assert zeros == plain
    with pytest.raises(ConfigError, match="stage3_max_live_parameters: must be >= 0"):
        EngineConfig.from_ds_config(
            {
                "train_batch_size": 4,
                "zero_optimization": {"stage": 3, "stage3_max_live_parameters": -1},
            }
        )
