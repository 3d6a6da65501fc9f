"""Record DeepSpeed 0.19.8's lr schedules and optimizer choices as JSON test fixtures.

Runs only in the DeepSpeed reference venv, never with minispeed importable:

    env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python scripts/record_ds_schedules.py

It writes two files under `tests/engine/fixtures/`:

- `ds_schedules.json`: for each scheduler config (type, params, param groups, optimizer kind),
  what DeepSpeed's `deepspeed.runtime.lr_schedules` class writes into the optimizer at
  construction and after each of 60 `step()` calls (group lrs, betas, `get_last_lr()`,
  `get_lr()`, `state_dict()`); and for configs DeepSpeed refuses, the exception it raises.
- `ds_optimizers.json`: for each `"optimizer"` section (with and without offload), the class
  DeepSpeed's `DeepSpeedEngine._configure_basic_optimizer` picks and the hyper-parameters it ends
  up with (constructor defaults applied), or the exception it raises. DeepSpeed's own fused/CPU
  optimizer classes are replaced by recorders for this (their kernels need a JIT build that has
  nothing to do with the choice); torch.optim classes are built for real.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
from deepspeed.runtime import lr_schedules
from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
from deepspeed.runtime.engine import DeepSpeedEngine

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "engine" / "fixtures"
STEPS = 60

# (name, type, params, group lrs, optimizer kind). Steps and sizes are small so 60 steps cross
# every phase: warm-up, hold/decay, the cycle's halves and stairs, the post-cycle decay.
SCHEDULES: list[tuple[str, str, dict[str, Any], list[float], str]] = [
    (
        "warmup_log",
        "WarmupLR",
        {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 20},
        [0.1],
        "adamw",
    ),
    (
        "warmup_linear_2groups",
        "WarmupLR",
        {
            "warmup_min_lr": [0.0, 1e-4],
            "warmup_max_lr": [1e-3, 2e-3],
            "warmup_num_steps": 17,
            "warmup_type": "linear",
        },
        [0.1, 0.2],
        "adamw",
    ),
    ("warmup_max_default_is_group_lr", "WarmupLR", {"warmup_num_steps": 10}, [0.05, 0.02], "sgd"),
    (
        "warmup_one_step_becomes_two",
        "WarmupLR",
        {"warmup_max_lr": 1e-3, "warmup_num_steps": 1},
        [0.1],
        "adamw",
    ),
    (
        "warmup_decreasing",
        "WarmupLR",
        {
            "warmup_min_lr": 2e-3,
            "warmup_max_lr": 1e-3,
            "warmup_num_steps": 8,
            "warmup_type": "linear",
        },
        [0.1],
        "adamw",
    ),
    (
        "warmup_decay_log",
        "WarmupDecayLR",
        {
            "total_num_steps": 50,
            "warmup_min_lr": 1e-5,
            "warmup_max_lr": 1e-3,
            "warmup_num_steps": 10,
        },
        [0.1],
        "adamw",
    ),
    (
        "warmup_decay_linear_defaults_max",
        "WarmupDecayLR",
        {"total_num_steps": 40, "warmup_num_steps": 12, "warmup_type": "linear"},
        [0.1, 0.3],
        "sgd",
    ),
    (
        "warmup_decay_total_below_warmup",
        "WarmupDecayLR",
        {"total_num_steps": 5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10},
        [0.1],
        "adamw",
    ),
    (
        "warmup_cosine_log",
        "WarmupCosineLR",
        {"total_num_steps": 50, "warmup_num_steps": 10},
        [0.01],
        "adamw",
    ),
    (
        "warmup_cosine_linear_ratios",
        "WarmupCosineLR",
        {
            "total_num_steps": 45,
            "warmup_min_ratio": 0.1,
            "warmup_num_steps": 7,
            "cos_min_ratio": 0.05,
            "warmup_type": "linear",
        },
        [0.01, 0.002],
        "adamw",
    ),
    (
        "warmup_cosine_total_below_warmup",
        "WarmupCosineLR",
        {"total_num_steps": 3, "warmup_num_steps": 6},
        [0.01],
        "sgd",
    ),
    (
        "one_cycle_basic",
        "OneCycle",
        {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 10},
        [0.1],
        "adamw",
    ),
    (
        "one_cycle_asymmetric_decay",
        "OneCycle",
        {
            "cycle_min_lr": 1e-4,
            "cycle_max_lr": 1e-2,
            "cycle_first_step_size": 7,
            "cycle_second_step_size": 13,
            "decay_step_size": 3,
            "decay_lr_rate": 0.5,
            "decay_mom_rate": 0.01,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
        },
        [0.1, 0.1],
        "adamw",
    ),
    (
        "one_cycle_stairs",
        "OneCycle",
        {
            "cycle_min_lr": [1e-4, 2e-4],
            "cycle_max_lr": [1e-2, 3e-2],
            "cycle_first_step_size": 12,
            "cycle_second_step_size": 9,
            "cycle_first_stair_count": 4,
            "cycle_second_stair_count": 3,
            "decay_step_size": 5,
            "decay_lr_rate": 0.2,
        },
        [0.1, 0.1],
        "adamw",
    ),
    (
        "one_cycle_sgd_no_betas",
        "OneCycle",
        {
            "cycle_min_lr": 1e-3,
            "cycle_max_lr": 5e-3,
            "cycle_first_step_size": 8,
            "decay_step_size": 2,
            "decay_lr_rate": 0.1,
        },
        [0.1],
        "sgd",
    ),
    (
        "one_cycle_momentum_off",
        "OneCycle",
        {
            "cycle_min_lr": 1e-3,
            "cycle_max_lr": 5e-3,
            "cycle_first_step_size": 6,
            "cycle_momentum": False,
        },
        [0.1],
        "adamw",
    ),
    (
        "one_cycle_zero_second_half",
        "OneCycle",
        {
            "cycle_min_lr": 1e-3,
            "cycle_max_lr": 5e-3,
            "cycle_first_step_size": 9,
            "cycle_second_step_size": 0,
        },
        [0.1],
        "adamw",
    ),
    (
        "lr_range_continuous",
        "LRRangeTest",
        {
            "lr_range_test_min_lr": 1e-4,
            "lr_range_test_step_size": 5,
            "lr_range_test_step_rate": 0.5,
        },
        [0.1],
        "adamw",
    ),
    (
        "lr_range_staircase_2groups",
        "LRRangeTest",
        {
            "lr_range_test_min_lr": [1e-4, 1e-3],
            "lr_range_test_step_size": 7,
            "lr_range_test_step_rate": 2.0,
            "lr_range_test_staircase": True,
        },
        [0.1, 0.1],
        "sgd",
    ),
    ("lr_range_defaults", "LRRangeTest", {}, [0.1], "adamw"),
    (
        "warmup_resumed_by_param",
        "WarmupLR",
        {"warmup_max_lr": 1e-3, "warmup_num_steps": 10, "last_batch_iteration": 4},
        [0.1],
        "adamw",
    ),
]

# Configs DeepSpeed refuses, with the key at fault: the fixture records the exception; minispeed
# must refuse them too, naming the key.
REFUSED_SCHEDULES: list[tuple[str, str, dict[str, Any], str]] = [
    ("warmup_zero_steps", "WarmupLR", {"warmup_num_steps": 0}, "warmup_num_steps"),
    ("warmup_negative_steps", "WarmupLR", {"warmup_num_steps": -5}, "warmup_num_steps"),
    ("warmup_float_steps", "WarmupLR", {"warmup_num_steps": 10.0}, "warmup_num_steps"),
    (
        "cosine_zero_steps",
        "WarmupCosineLR",
        {"total_num_steps": 10, "warmup_num_steps": 0},
        "warmup_num_steps",
    ),
    (
        "lr_range_zero_step_size",
        "LRRangeTest",
        {"lr_range_test_step_size": 0},
        "lr_range_test_step_size",
    ),
    (
        "one_cycle_zero_first_half",
        "OneCycle",
        {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 0},
        "cycle_first_step_size",
    ),
    (
        "one_cycle_negative_second_half",
        "OneCycle",
        {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_second_step_size": -1},
        "cycle_second_step_size",
    ),
    ("warmup_list_length", "WarmupLR", {"warmup_min_lr": [0.0, 0.0, 0.0]}, "warmup_min_lr"),
    ("warmup_misspelled_key", "WarmupLR", {"warmup_num_step": 10}, "warmup_num_step"),
    ("decay_missing_total", "WarmupDecayLR", {"warmup_num_steps": 10}, "total_num_steps"),
]

# (name, optimizer section, offload). Offload is DeepSpeed's `zero_use_cpu_optimizer()`.
OPTIMIZERS: list[tuple[str, dict[str, Any], bool]] = [
    ("adam_default_is_adamw", {"type": "Adam", "params": {"lr": 1e-3}}, False),
    (
        "adam_w_mode_false",
        {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.1}},
        False,
    ),
    (
        "adamw_wd",
        {
            "type": "AdamW",
            "params": {"lr": 2e-3, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.05},
        },
        False,
    ),
    (
        "adamw_ignores_adam_w_mode_false",
        {"type": "AdamW", "params": {"lr": 1e-3, "adam_w_mode": False}},
        False,
    ),
    ("adam_lowercase", {"type": "adam", "params": {"lr": 1e-3}}, False),
    (
        "adam_torch",
        {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}},
        False,
    ),
    (
        "adamw_torch_default_wd",
        {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        False,
    ),
    (
        "adam_torch_amsgrad",
        {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "amsgrad": True}},
        False,
    ),
    ("adam_amsgrad_refused", {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True}}, False),
    (
        "adam_max_grad_norm_refused",
        {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}},
        False,
    ),
    ("adam_offload", {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}}, True),
    (
        "adam_offload_l2",
        {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "weight_decay": 0.01}},
        True,
    ),
    ("adamw_offload_betas", {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}}, True),
    ("adam_offload_torch_adam", {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}, True),
    ("sgd", {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, False),
    ("sgd_offload", {"type": "SGD", "params": {"lr": 0.1, "weight_decay": 1e-4}}, True),
    ("sgd_lowercase", {"type": "sgd", "params": {"lr": 0.1}}, False),
    (
        "adagrad",
        {
            "type": "Adagrad",
            "params": {"lr": 0.01, "lr_decay": 0.001, "initial_accumulator_value": 0.1},
        },
        False,
    ),
    (
        "adagrad_offload",
        {"type": "Adagrad", "params": {"lr": 0.01, "eps": 1e-8, "weight_decay": 0.001}},
        True,
    ),
    ("lion", {"type": "Lion", "params": {"lr": 1e-4, "weight_decay": 0.01}}, False),
    ("lion_defaults", {"type": "lion", "params": {}}, False),
    ("lion_offload", {"type": "Lion", "params": {"lr": 1e-4, "betas": [0.95, 0.98]}}, True),
    ("rmsprop_torch_passthrough", {"type": "RMSprop", "params": {"lr": 0.01, "alpha": 0.9}}, False),
    (
        "onebit_adam_removed",
        {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 10}},
        False,
    ),
    (
        "onebit_lamb_removed",
        {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 10}},
        False,
    ),
    ("unknown_type", {"type": "AdamX", "params": {"lr": 1e-3}}, False),
]


def plain(value: Any) -> Any:
    """JSON-able copy: tuples to lists, tensors to floats."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if k != "params"}
    return value


def make_optimizer(kind: str, group_lrs: list[float]) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in group_lrs]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=group_lrs[0])
    return torch.optim.SGD(groups, lr=group_lrs[0], momentum=0.9)


def snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "lrs": [g["lr"] for g in optimizer.param_groups],
        "betas": [plain(g["betas"]) if "betas" in g else None for g in optimizer.param_groups],
    }


def last_lr(scheduler: Any) -> Any:
    try:
        return plain(scheduler.get_last_lr())
    except AssertionError:
        return None  # DeepSpeed asserts "need to call step() first"


def record_schedule(kind: str, params: dict[str, Any], group_lrs: list[float], opt: str) -> dict:
    optimizer = make_optimizer(opt, group_lrs)
    scheduler = getattr(lr_schedules, kind)(optimizer, **params)
    record: dict[str, Any] = {
        "construction": {**snapshot(optimizer), "last_lr": last_lr(scheduler)},
        "steps": [],
    }
    for _ in range(STEPS):
        scheduler.step()
        record["steps"].append(
            {
                **snapshot(optimizer),
                "last_lr": last_lr(scheduler),
                "get_lr": plain(scheduler.get_lr()),
                "state_dict": scheduler.state_dict(),
            }
        )
    return record


def record_refusal(kind: str, params: dict[str, Any]) -> dict[str, str]:
    optimizer = make_optimizer("adamw", [0.1])
    try:
        getattr(lr_schedules, kind)(optimizer, **params)
    except Exception as error:  # we record whatever DeepSpeed raises
        return {"error": type(error).__name__, "message": str(error)}
    raise AssertionError(f"DeepSpeed accepted {kind} {params}; move it to SCHEDULES")


class Recorder:
    """Stands in for a DeepSpeed optimizer class: binds the call to the real signature."""

    def __init__(self, real: type) -> None:
        self.real = real

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        bound = inspect.signature(self.real.__init__).bind(None, params, *args, **kwargs)
        bound.apply_defaults()
        hyper = {
            k: v for k, v in bound.arguments.items() if k not in ("self", "params", "model_params")
        }
        if self.real.__name__ == "FusedAdam" and hyper.get("amsgrad"):
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        return {"class": self.real.__name__, "hyper": plain(hyper)}


class FakeEngine:
    """The few engine accessors `_configure_basic_optimizer` reads, from one config section."""

    _configure_basic_optimizer = DeepSpeedEngine._configure_basic_optimizer
    get_optimizer_configuration = DeepSpeedEngine.get_optimizer_configuration

    def __init__(self, section: dict[str, Any], offload: bool) -> None:
        name = section["type"]
        # DeepSpeedConfig lower-cases only the names of DeepSpeed's own optimizers.
        self._name = name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name
        self._params = section.get("params")
        self._offload = offload
        self.zenflow = False
        self.has_moe_layers = False

    def optimizer_name(self) -> str:
        return self._name

    def optimizer_params(self) -> dict[str, Any] | None:
        return self._params

    def zero_use_cpu_optimizer(self) -> bool:
        return self._offload

    def bf16_optimizer_states(self) -> bool:
        return False


def record_optimizer(section: dict[str, Any], offload: bool) -> dict[str, Any]:
    params = [torch.nn.Parameter(torch.zeros(3))]
    try:
        built = FakeEngine(section, offload)._configure_basic_optimizer(params)
    except Exception as error:  # we record whatever DeepSpeed raises
        return {"error": type(error).__name__, "message": str(error)}
    if isinstance(built, dict):
        return built
    hyper = {k: v for k, v in built.param_groups[0].items() if k != "params"}
    return {"class": f"torch.optim.{type(built).__name__}", "hyper": plain(hyper)}


def main() -> None:
    assert deepspeed.__version__ == "0.19.8", deepspeed.__version__
    import deepspeed.ops.adagrad as ds_adagrad
    import deepspeed.ops.adam as ds_adam
    import deepspeed.ops.lion as ds_lion

    for module, names in (
        (ds_adam, ["FusedAdam", "DeepSpeedCPUAdam"]),
        (ds_adagrad, ["DeepSpeedCPUAdagrad"]),
        (ds_lion, ["FusedLion", "DeepSpeedCPULion"]),
    ):
        for name in names:
            setattr(module, name, Recorder(getattr(module, name)))

    FIXTURES.mkdir(parents=True, exist_ok=True)
    schedules = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "steps": STEPS,
        "accepted": [
            {
                "name": n,
                "type": t,
                "params": p,
                "group_lrs": g,
                "optimizer": o,
                **record_schedule(t, p, g, o),
            }
            for n, t, p, g, o in SCHEDULES
        ],
        "refused": [
            {"name": n, "type": t, "params": p, "key": k, **record_refusal(t, p)}
            for n, t, p, k in REFUSED_SCHEDULES
        ],
    }
    optimizers = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "cases": [
            {"name": n, "section": s, "offload": o, **record_optimizer(s, o)}
            for n, s, o in OPTIMIZERS
        ],
    }
    for name, data in (("ds_schedules.json", schedules), ("ds_optimizers.json", optimizers)):
        text = json.dumps(data, indent=1, allow_nan=False)
        (FIXTURES / name).write_text(text + "\n")
        print(f"wrote {FIXTURES / name}")


if __name__ == "__main__":
    if os.environ.get("PYTHONPATH"):
        raise SystemExit("run with `env -u PYTHONPATH`: minispeed must not be importable here")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import require_deepspeed

    require_deepspeed()  # refuses minispeed under DeepSpeed's name
    main()
