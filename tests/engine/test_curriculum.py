"""Megatron-DeepSpeed's legacy training sections against DeepSpeed 0.19.8, which removed them
(Note [Megatron-DeepSpeed's legacy sections], minispeed.engine.config).

- `CurriculumScheduler` (`deepspeed.runtime.data_pipeline.curriculum_scheduler`, over
  `minispeed.engine.curriculum`) gives DeepSpeed's difficulty at every step for every schedule
  type and refuses the configs DeepSpeed refuses (scripts/record_ds_curriculum.py).
- A 2-process loop that truncates a tiny GPT's sequences to the schedule's length trains as the
  same script does on DeepSpeed, at ZeRO-1 and on a 2-stage pipeline that resets its activation
  shapes at each new length (scripts/record_ds_curriculum_gpt.py).
- `curriculum_learning`, `progressive_layer_drop` and `elasticity`, which DeepSpeed 0.19.8
  refuses, are kept with DeepSpeed 0.17.6's meaning (test_legacy.py); `deepspeed.elasticity`
  with them, `deepspeed.runtime.progressive_layer_drop` absent as in 0.19.8.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.config import ConfigError
from minispeed.core.testing import run_distributed
from minispeed.engine.config import EngineConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SCHEDULER_IMPORTS = {
    "from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler\n": (
        "from minispeed.engine.runtime.data_pipeline.curriculum_scheduler import "
        "CurriculumScheduler\n"
    ),
}

PIPE_IMPORT = {
    "from deepspeed.pipe import LayerSpec, PipelineModule\n": (
        "from minispeed.engine.pipe import LayerSpec, PipelineModule\n"
    )
}


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_curriculum_scheduler_matches_deepspeed_at_every_step() -> None:
    recorded = _fixture("ds_curriculum.json")["schedules"]
    ours = ds_scripts.load("record_ds_curriculum.py", SCHEDULER_IMPORTS).main()
    assert set(ours) == set(recorded)
    for name, ref in recorded.items():
        if "error" not in ref:
            assert ours[name] == ref, name  # difficulties per step, and the state, exactly
            continue
        assert "error" in ours[name], (name, ours[name])
        # Where DeepSpeed's assertion names the missing key, ours names it too (ours also say
        # what is wrong where DeepSpeed's is bare).
        for key in re.findall(
            r"requires the (?:schedule_)?config '(\w+)'", ref["error"]["message"]
        ):
            assert key in ours[name]["error"]["message"], (name, ours[name], ref)
        assert ours[name]["error"]["message"], name


def _gpt(rank: int, world_size: int) -> dict:
    imports = {**ds_scripts.PLAIN_IMPORTS, **SCHEDULER_IMPORTS, **PIPE_IMPORT}
    script = ds_scripts.load("record_ds_curriculum_gpt.py", imports)
    return {"zero1": script.main(), "pipeline": script.pipeline()}


def test_sequence_curriculum_script_trains_as_on_deepspeed() -> None:
    """ZeRO-1 with the length passed to the forward, and a 2-stage pipeline fed truncated
    micro-batches with `reset_activation_shape()` at each new length."""
    runs = run_distributed(_gpt, world_size=2, timeout_s=240)
    for ours, ref in zip(runs, _fixture("ds_curriculum_gpt.json")["ranks"], strict=True):
        ds_scripts.assert_matches(ours, ref)
    for part in ("zero1", "pipeline"):
        assert [s["seqlen"] for s in runs[0][part]["steps"]] == [4, 8, 12, 16, 16, 16]


@pytest.mark.parametrize("section", ["curriculum_learning", "progressive_layer_drop", "elasticity"])
def test_legacy_section_enabled_is_kept_from_deepspeed_0_17_6(section: str) -> None:
    """DeepSpeed 0.19.8 refuses all three; minispeed keeps them with DeepSpeed 0.17.6's meaning
    (tests/engine/test_legacy.py). An elastic section beside batch keys is refused naming
    them, as 0.17.6 refuses it."""
    recorded = _fixture("ds_curriculum.json")
    assert recorded["sections"][f"{section}.enabled=True"]["type"] == "DeepSpeedConfigError"
    value = ds_scripts.load("record_ds_curriculum.py", SCHEDULER_IMPORTS).LEGACY_SECTIONS[section]
    if section == "elasticity":
        with pytest.raises(ConfigError, match=r"^elasticity: .*train_batch_size"):
            EngineConfig.from_ds_config({"train_batch_size": 8, section: value})
        cfg = EngineConfig.from_ds_config({section: value}, data_parallel_size=2)
        assert cfg.train_batch_size == cfg.micro_batch_size * cfg.gradient_accumulation_steps * 2
    else:
        EngineConfig.from_ds_config({"train_batch_size": 8, section: value})
    # Disabled, it changes nothing: accepted here (DeepSpeed refuses it too; see the Note).
    EngineConfig.from_ds_config({"train_batch_size": 8, section: {"enabled": False}})


def test_legacy_modules_and_engine_names_are_absent_as_in_deepspeed() -> None:
    recorded = _fixture("ds_curriculum.json")
    from minispeed.engine import Engine

    for path, present in recorded["modules"].items():
        assert not present
        if path == "deepspeed.elasticity":  # kept from DeepSpeed 0.17.6 (test_legacy.py)
            assert importlib.import_module("minispeed.engine.elasticity").compute_elastic_config
            continue
        with pytest.raises(ImportError, match=r"gone from DeepSpeed 0\.19\.8 too"):
            importlib.import_module(path)
    # DeepSpeed 0.19.8 dropped get_pld_theta; minispeed keeps 0.17.6's (test_legacy.py).
    assert not recorded["engine_names"]["get_pld_theta"]
    assert hasattr(Engine, "get_pld_theta")
