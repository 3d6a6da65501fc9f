"""Record what DeepSpeed 0.19.8 does with Megatron-DeepSpeed's legacy training features: the
curriculum difficulty schedule (`CurriculumScheduler`), and its answer to the legacy
`curriculum_learning`, `progressive_layer_drop` and `elasticity` sections and their modules.

Runs only in the DeepSpeed reference venv, never with minispeed importable:

    env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python scripts/record_ds_curriculum.py

It writes `tests/engine/fixtures/ds_curriculum.json`:

- `schedules`: for each schedule config (`fixed_linear`, `fixed_root`, `fixed_discrete`,
  `custom`, and edge cases), `get_difficulty(step)` and `update_difficulty(step)` for steps
  0..STEPS-1 on one scheduler, then its `state`; or, for a config DeepSpeed refuses, the
  exception's type and message. A `custom` schedule's function is named in `CUSTOM`.
- `sections`: for each legacy section, enabled and disabled, the error `DeepSpeedConfig` raises.
- `modules` / `engine_names`: whether `deepspeed.elasticity`, `compute_elastic_config`,
  `deepspeed.runtime.progressive_layer_drop` and the engine's `get_pld_theta` /
  `set_custom_curriculum_learning_schedule` exist.

`tests/engine/test_curriculum.py` runs this same file's `main()` with its import line changed
to minispeed's and compares.
"""

import importlib
from pathlib import Path

from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_curriculum.json"
STEPS = 40

# Custom schedules by name (a JSON fixture cannot hold a function).
CUSTOM = {"ramp": lambda step: min(64, 8 + 4 * step), "down": lambda step: max(8, 64 - 8 * step)}

LINEAR = {"total_curriculum_step": 20, "difficulty_step": 8}
SCHEDULES = [
    ("fixed_linear", {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
                      "schedule_config": LINEAR}, None),
    ("fixed_linear_min_off_step", {"min_difficulty": 5, "max_difficulty": 64,
                                   "schedule_type": "fixed_linear",
                                   "schedule_config": {"total_curriculum_step": 30,
                                                       "difficulty_step": 16}}, None),
    ("fixed_linear_step_not_8", {"min_difficulty": 2, "max_difficulty": 30,
                                 "schedule_type": "fixed_linear",
                                 "schedule_config": {"total_curriculum_step": 10,
                                                     "difficulty_step": 3}}, None),
    ("fixed_root_2", {"min_difficulty": 8, "max_difficulty": 128, "schedule_type": "fixed_root",
                      "schedule_config": {**LINEAR, "root_degree": 2}}, None),
    ("fixed_root_3", {"min_difficulty": 16, "max_difficulty": 64, "schedule_type": "fixed_root",
                      "schedule_config": {"total_curriculum_step": 25, "difficulty_step": 16,
                                          "root_degree": 3}}, None),
    ("fixed_discrete", {"min_difficulty": 1, "max_difficulty": 3,
                        "schedule_type": "fixed_discrete",
                        "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]}}, None),
    ("fixed_discrete_not_rising", {"min_difficulty": 4, "max_difficulty": 8,
                                   "schedule_type": "fixed_discrete",
                                   "schedule_config": {"difficulty": [4, 16, 8],
                                                       "max_step": [3, 6]}}, None),
    ("custom_ramp", {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "custom"},
     "ramp"),
    ("custom_down", {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "custom"},
     "down"),
    # Refused configs.
    ("no_min", {"max_difficulty": 64, "schedule_type": "fixed_linear",
                "schedule_config": LINEAR}, None),
    ("no_max", {"min_difficulty": 8, "schedule_type": "fixed_linear",
                "schedule_config": LINEAR}, None),
    ("no_type", {"min_difficulty": 8, "max_difficulty": 64, "schedule_config": LINEAR}, None),
    ("unknown_type", {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "cosine",
                      "schedule_config": LINEAR}, None),
    ("linear_no_schedule_config", {"min_difficulty": 8, "max_difficulty": 64,
                                   "schedule_type": "fixed_linear"}, None),
    ("linear_no_total", {"min_difficulty": 8, "max_difficulty": 64,
                         "schedule_type": "fixed_linear",
                         "schedule_config": {"difficulty_step": 8}}, None),
    ("linear_no_step", {"min_difficulty": 8, "max_difficulty": 64,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"total_curriculum_step": 8}}, None),
    ("root_no_degree", {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_root",
                        "schedule_config": LINEAR}, None),
    ("discrete_no_max_step", {"min_difficulty": 1, "max_difficulty": 3,
                              "schedule_type": "fixed_discrete",
                              "schedule_config": {"difficulty": [1, 2, 3]}}, None),
    ("discrete_lengths", {"min_difficulty": 1, "max_difficulty": 3,
                          "schedule_type": "fixed_discrete",
                          "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5]}}, None),
    ("discrete_empty", {"min_difficulty": 1, "max_difficulty": 3,
                        "schedule_type": "fixed_discrete",
                        "schedule_config": {"difficulty": [1], "max_step": []}}, None),
    ("custom_unset", {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "custom"},
     None),
]  # fmt: skip

LEGACY_SECTIONS = {
    "curriculum_learning": SCHEDULES[0][1] | {"enabled": True, "curriculum_type": "seqlen"},
    "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.001},
    "elasticity": {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4],
                   "min_gpus": 1, "max_gpus": 8, "version": 0.2},
}  # fmt: skip


def _error(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e)}


def _schedule(config: dict, custom: str | None) -> dict:
    try:
        scheduler = CurriculumScheduler(config)
        if custom is not None:
            scheduler.set_custom_get_difficulty(CUSTOM[custom])
        got = [scheduler.get_difficulty(step) for step in range(STEPS)]
        updated = [scheduler.update_difficulty(step) for step in range(STEPS)]
    except Exception as e:
        return {"error": _error(e)}
    return {"get": got, "update": updated, "state": scheduler.state}


def main() -> dict:
    """The schedules (see the module docstring); the legacy sections and modules are recorded
    by `legacy()`, DeepSpeed's alone."""
    return {name: _schedule(config, custom) for name, config, custom in SCHEDULES}


def legacy() -> dict:
    """DeepSpeed's answer to the legacy sections, modules and engine names."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    sections = {}
    for name, value in LEGACY_SECTIONS.items():
        for enabled in (True, False):
            try:
                DeepSpeedConfig({"train_batch_size": 8, name: {**value, "enabled": enabled}})
                sections[f"{name}.enabled={enabled}"] = None
            except Exception as e:
                sections[f"{name}.enabled={enabled}"] = _error(e)
    modules = {}
    for path in ("deepspeed.elasticity", "deepspeed.runtime.progressive_layer_drop"):
        try:
            importlib.import_module(path)
            modules[path] = True
        except ImportError:
            modules[path] = False
    names = ("get_pld_theta", "set_custom_curriculum_learning_schedule", "curriculum_scheduler")
    return {
        "sections": sections,
        "modules": modules,
        "engine_names": {n: hasattr(DeepSpeedEngine, n) for n in names},
    }


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import deepspeed
    import torch
    from ds_fixture import require_deepspeed, write_json

    result = {
        "deepspeed": require_deepspeed(),
        "torch": torch.__version__,
        "command": "env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python "
        "scripts/record_ds_curriculum.py",
        "steps": STEPS,
        "schedules": main(),
        **legacy(),
    }
    assert deepspeed.__version__ == result["deepspeed"]
    write_json(result, FIXTURE)
