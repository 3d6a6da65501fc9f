"""Megatron-DeepSpeed's legacy training sections against DeepSpeed 0.19.8, which removed them
(Note [Megatron-DeepSpeed's legacy sections], minispeed.engine.config).

- `CurriculumScheduler` (`deepspeed.runtime.data_pipeline.curriculum_scheduler`, over
  `minispeed.engine.curriculum`) gives DeepSpeed's difficulty at every step for every schedule
  type and refuses the configs DeepSpeed refuses (scripts/record_ds_curriculum.py).
- A 2-process loop that truncates a tiny GPT's sequences to the schedule's length trains as the
  same script does on DeepSpeed, at ZeRO-1 and on a 2-stage pipeline that resets its activation
  shapes at each new length (scripts/record_ds_curriculum_gpt.py).
- `elasticity` enabled is refused, as DeepSpeed refuses it, with what to do; `curriculum_learning`
  and `progressive_layer_drop` are kept with DeepSpeed 0.17.6's meaning (test_legacy.py); their
  modules are absent, as there.
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
def test_legacy_section_enabled_is_kept_or_refused_naming_it(section: str) -> None:
    """DeepSpeed 0.19.8 refuses all three; minispeed keeps the curriculum and layer drop with
    DeepSpeed 0.17.6's meaning (tests/engine/test_legacy.py) and refuses elasticity."""
    recorded = _fixture("ds_curriculum.json")
    assert recorded["sections"][f"{section}.enabled=True"]["type"] == "DeepSpeedConfigError"
    value = ds_scripts.load("record_ds_curriculum.py", SCHEDULER_IMPORTS).LEGACY_SECTIONS[section]
    if section == "elasticity":
        with pytest.raises(ConfigError, match=rf"^{section}: .*DeepSpeed 0\.19\.8 removed"):
            EngineConfig.from_ds_config({"train_batch_size": 8, section: value})
    else:
        EngineConfig.from_ds_config({"train_batch_size": 8, section: value})
    # Disabled, it changes nothing: accepted here (DeepSpeed refuses it too; see the Note).
    EngineConfig.from_ds_config({"train_batch_size": 8, section: {"enabled": False}})


def test_legacy_modules_and_engine_names_are_absent_as_in_deepspeed() -> None:
    recorded = _fixture("ds_curriculum.json")
    from minispeed.engine import Engine

    for path, present in recorded["modules"].items():
        assert not present
        with pytest.raises(ImportError, match=r"gone from DeepSpeed 0\.19\.8 too"):
            importlib.import_module(path)
    # DeepSpeed 0.19.8 dropped get_pld_theta; minispeed keeps 0.17.6's (test_legacy.py).
    assert not recorded["engine_names"]["get_pld_theta"]
    assert hasattr(Engine, "get_pld_theta")
