"""The DeepSpeed names added for scripts written against DeepSpeed's documented surface answer with
DeepSpeed's meaning (no processes: each is a local call).

`DeepSpeedConfig` resolves a config as `initialize` does; `move_to_device` moves nested tensors
(in place where the criterion says); `clone_tensors_for_torch_save` copies each tensor out of
its storage; `OnDevice` builds on the meta device in the dtype asked; `set_z3_leaf_modules`
finds modules by class or class name and refuses a name it cannot find; DeepSpeed's schedule
name constants are the classes' names; `get_accelerator().device_count()` is the node's process
count on the CPU; `runtime.zero.config.DeepSpeedZeroConfig` answers each field as DeepSpeed
0.19.8 does (`fixtures/ds_zero_config.json`, `scripts/record_ds_zero_config.py`), minispeed's
three documented defaults aside; `moe.sharded_moe`'s gating functions return DeepSpeed 0.19.8's
tensors for the same logits and seed (`fixtures/ds_sharded_moe.json`,
`scripts/record_ds_sharded_moe.py`), top-1's random token selection included.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ZERO_CONFIG = json.loads((FIXTURES / "ds_zero_config.json").read_text())
SHARDED_MOE = json.loads((FIXTURES / "ds_sharded_moe.json").read_text())


def test_deepspeed_config_answers_deepspeeds_attribute_names() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    class Mpu:
        def get_data_parallel_world_size(self) -> int:
            return 4

    cfg = DeepSpeedConfig(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 3,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2},
            "bf16": {"enabled": True},
        },
        mpu=Mpu(),
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (24, 2)
    assert cfg.gradient_accumulation_steps == 3 and cfg.zero_optimization_stage == 2
    assert cfg.zero_enabled and cfg.bfloat16_enabled and not cfg.fp16_enabled
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params == {"lr": 1e-3}
    assert cfg.gradient_clipping == 1.0  # DeepSpeed's default when left out
    with pytest.raises(DeepSpeedConfigError, match=r"zero_optimization\.stage"):
        DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": 5}})


def test_move_to_device_and_clone_for_save_keep_the_structure() -> None:
    from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
    from deepspeed.runtime.utils import move_to_device

    base = torch.arange(6.0)
    item = collections.OrderedDict(a=base[:2], b=[base[2:4], (base[4:], 7)])
    saved = clone_tensors_for_torch_save(item)
    assert type(saved) is collections.OrderedDict and saved["b"][1][1] == 7
    assert all(t.untyped_storage().nbytes() == 8 for t in (saved["a"], saved["b"][0]))
    base.zero_()
    assert saved["b"][1][0].tolist() == [4.0, 5.0]  # copies, not views of `base`

    t = torch.ones(2)
    moved = move_to_device({"x": [t]}, "cpu", criterion_func=lambda x: True)
    assert moved["x"][0] is t  # in place where the criterion holds, as DeepSpeed's


def test_on_device_builds_on_meta_in_the_dtype_asked() -> None:
    from deepspeed import OnDevice

    with OnDevice(dtype=torch.float16, device="meta"):
        layer = nn.Linear(4, 4)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    assert torch.get_default_dtype() == torch.float32  # restored
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_set_z3_leaf_modules_by_class_or_name() -> None:
    from deepspeed.utils import get_z3_leaf_modules, set_z3_leaf_modules, z3_leaf_module

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(2, 2)

    model = nn.Sequential(Experts(), nn.Linear(2, 2), Experts())
    assert set_z3_leaf_modules(model, ["Experts"]) == [model[0], model[2]]
    assert get_z3_leaf_modules(model) == [model[0], model[2]] and z3_leaf_module(model[0])
    with pytest.raises(ValueError, match="no module of"):
        set_z3_leaf_modules(model, [nn.Conv2d])
    assert set_z3_leaf_modules(model, [nn.Conv2d], raise_if_not_found=False) == []


def test_schedule_names_and_the_cpu_device_count(monkeypatch) -> None:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime import lr_schedules

    assert [
        c.__name__
        for c in (
            lr_schedules.LRRangeTest,
            lr_schedules.OneCycle,
            lr_schedules.WarmupLR,
            lr_schedules.WarmupDecayLR,
            lr_schedules.WarmupCosineLR,
        )
    ] == lr_schedules.VALID_LR_SCHEDULES
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert get_accelerator().device_count() == 3
    monkeypatch.setenv("LOCAL_SIZE", "4")  # DeepSpeed's own launcher's variable wins
    assert get_accelerator().device_count() == 4


def _minispeeds_defaults(section: dict, theirs: dict) -> dict:
    """DeepSpeed's fields with minispeed's three defaults that differ on purpose, where the
    section leaves the key out (runtime/zero/config.py and offload_config.py say why), and the
    deprecated `cpu_offload` keys at false, the one value minispeed accepts (DeepSpeed's null
    means the same: zero/config.py)."""
    expected = dict(theirs)
    for name in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
        expected[name] = section.get(name, False)
    stage = section.get("stage", 0)
    expected["overlap_comm"] = section.get("overlap_comm", stage != 2)
    for name in ("offload_param", "offload_optimizer"):
        if theirs[name] is not None:
            given = section[name]
            expected[name] = {**theirs[name], "pin_memory": given.get("pin_memory", False)}
            if "max_in_cpu" in theirs[name]:
                expected[name]["max_in_cpu"] = given.get("max_in_cpu")
    return expected


@pytest.mark.parametrize("case", ZERO_CONFIG["cases"], ids=lambda c: json.dumps(c["section"]))
def test_zero_config_model_answers_deepspeeds_fields(case: dict) -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ours = DeepSpeedZeroConfig(**case["section"])
    expected = _minispeeds_defaults(case["section"], case["fields"])
    compared = {}
    for name, value in expected.items():
        if name not in ours._fields:
            continue
        got = getattr(ours, name)
        if isinstance(value, dict):  # an offload model: compare the fields both have
            got = {k: getattr(got, k) for k in value if k in got._fields}
            value = {k: value[k] for k in got}
        compared[name] = (got, value)
    assert {k: g for k, (g, _) in compared.items()} == {k: v for k, (_, v) in compared.items()}
    # Every field minispeed answers is one of DeepSpeed's, MiCS's keys aside (DeepSpeed reads
    # them from the section outside this model).
    assert set(ours._fields) - set(compared) == {
        "mics_shard_size",
        "mics_hierarchical_params_gather",
    }


def test_zero_config_enums_and_unread_fields() -> None:
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    assert list(ZeroStageEnum.__members__) == ZERO_CONFIG["stage_names"]
    assert {m.name: m.value for m in ZeroStageEnum} == ZERO_CONFIG["stages"]
    assert {m.name: m.value for m in OffloadDeviceEnum} == ZERO_CONFIG["devices"]
    cfg = DeepSpeedZeroConfig(stage=3, offload_param={"device": "cpu"})
    assert cfg.stage == ZeroStageEnum.weights and cfg.offload_param.device == OffloadDeviceEnum.cpu
    with pytest.raises(AttributeError, match="minispeed does not read this DeepSpeed field"):
        cfg.leaf_module  # noqa: B018  (refused by name: set in code)
    with pytest.raises(ValueError, match=r"zero_optimization\.stage3_prefetch_bucket_sise"):
        DeepSpeedZeroConfig(stage3_prefetch_bucket_sise=1)


@pytest.mark.parametrize(
    "case", SHARDED_MOE["cases"], ids=lambda c: f"{c['function']}-{c['seed']}-{c['kwargs']}"
)
def test_gating_functions_return_deepspeeds_tensors(case: dict) -> None:
    from deepspeed.moe import sharded_moe

    logits = torch.tensor(case["logits"], requires_grad=True)
    torch.manual_seed(case["seed"])  # top-1's random token selection draws from it, as there
    gate = getattr(sharded_moe, case["function"])
    l_aux, combine, dispatch, counts = gate(logits, *case["args"], **case["kwargs"])
    assert l_aux.item() == pytest.approx(case["l_aux"], rel=1e-6)
    torch.testing.assert_close(combine, torch.tensor(case["combine_weights"]), rtol=1e-6, atol=1e-7)
    assert case["dispatch_equals_combine"] and torch.equal(dispatch, combine.bool())
    assert counts.tolist() == case["exp_counts"] and counts.dtype == torch.int64
    (l_aux + combine.sum()).backward()  # differentiable in the logits, as DeepSpeed's
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_gating_refusals_name_what_to_use() -> None:
    from deepspeed.moe import sharded_moe

    logits = torch.randn(8, 4)
    with pytest.raises(ImportError, match=r"minispeed\.moe\.TopKGate"):
        from deepspeed.moe.sharded_moe import TopKGate  # noqa: F401
    with pytest.raises(NotImplementedError, match="used_token"):
        sharded_moe.top1gating(logits, 1.0, 1, used_token=torch.ones(8))
    with pytest.raises(NotImplementedError, match="drop_policy='probs'"):
        sharded_moe.topkgating(logits, 2, 1.0, 1, drop_policy="position")


def test_utils_logging_is_the_engine_logger_with_deepspeeds_rank_rule(capsys) -> None:
    """Lightning's DeepSpeedStrategy sets `deepspeed.utils.logging.logger`'s level in its
    constructor; before the adapter that name was Python's `logging` module (no `logger`)."""
    import logging

    from minispeed.engine import utils
    from minispeed.engine.utils import logging as ds_logging

    assert utils.logging is ds_logging and ds_logging.logger is utils.logger
    ds_logging.logger.setLevel(logging.WARNING)
    assert not ds_logging.should_log_le("info") and ds_logging.should_log_le("error")
    ds_logging.set_log_level_from_string("INFO")
    assert ds_logging.get_current_level() == logging.INFO
    with pytest.raises(ValueError, match="log level 'loud' is not one of debug, info"):
        ds_logging.set_log_level_from_string("loud")
    # No process group: every process logs, "[Rank -1]" as DeepSpeed prints it.
    assert ds_logging.get_dist_msg("hello", ranks=[0]) == "[Rank -1] hello"
    ds_logging.print_dist("hi")
    assert capsys.readouterr().out == "[Rank -1] hi\n"


def test_profiler_strings_are_deepspeeds() -> None:
    """`deepspeed.profiling.flops_profiler`'s report strings, recorded from DeepSpeed 0.19.8
    (scripts/record_ds_profiler_strings.py, run here with its import changed to minispeed's),
    for numbers from micro to peta."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import ds_scripts

    script = ds_scripts.load(
        "record_ds_profiler_strings.py",
        {
            "    import deepspeed.profiling.flops_profiler as profiler\n": (
                "    import minispeed.engine.profiling.flops_profiler as profiler\n"
            )
        },
    )
    mine = script.main()
    recorded = json.loads((FIXTURES / "ds_profiler_strings.json").read_text())["strings"]
    assert mine == recorded
