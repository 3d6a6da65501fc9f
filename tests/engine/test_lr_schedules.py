"""lr schedules by ds_config name, against DeepSpeed 0.19.8's values step by step.

The expected values come from DeepSpeed itself (`scripts/record_ds_schedules.py` wrote
`fixtures/ds_schedules.json`): the lrs and betas written at construction and after each of 60
steps, `get_last_lr()`, `get_lr()` and `state_dict()`, compared to 1e-12 relative.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from minispeed.engine.lr_schedules import OneCycle, WarmupLR, build_scheduler

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "ds_schedules.json").read_text())
ACCEPTED = {case["name"]: case for case in FIXTURE["accepted"]}
REFUSED = {case["name"]: case for case in FIXTURE["refused"]}


def make_optimizer(kind: str, group_lrs: list[float]) -> torch.optim.Optimizer:
    """The optimizer the recording script used (same kind, groups and lrs)."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in group_lrs]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=group_lrs[0])
    return torch.optim.SGD(groups, lr=group_lrs[0], momentum=0.9)


def plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def assert_same(ours: Any, theirs: Any, what: str) -> None:
    """Equal structure; numbers equal to 1e-12 relative (zeros exactly)."""
    ours = plain(ours)
    if theirs is None or isinstance(theirs, (bool, str)):
        assert ours == theirs, f"{what}: {ours!r} != DeepSpeed's {theirs!r}"
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), f"{what}: {ours} vs {theirs}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{what}[{i}]")
    else:
        assert math.isclose(ours, theirs, rel_tol=1e-12, abs_tol=0.0), (
            f"{what}: {ours!r} != DeepSpeed's {theirs!r}"
        )


def snapshot(optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    try:
        last_lr = scheduler.get_last_lr()
    except RuntimeError:
        last_lr = None  # DeepSpeed asserts here; the fixture holds None
    return {
        "lrs": [g["lr"] for g in optimizer.param_groups],
        "betas": [g.get("betas") for g in optimizer.param_groups],
        "last_lr": last_lr,
    }


def build(case: dict[str, Any]) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = make_optimizer(case["optimizer"], case["group_lrs"])
    section = {"type": case["type"], "params": dict(case["params"])}
    return optimizer, build_scheduler(section, optimizer)


def assert_step(optimizer, scheduler, expected: dict[str, Any], what: str) -> None:
    got = snapshot(optimizer, scheduler)
    for key in ("lrs", "betas", "last_lr"):
        assert_same(got[key], expected[key], f"{what} {key}")
    assert_same(scheduler.get_lr(), expected["get_lr"], f"{what} get_lr")
    assert scheduler.state_dict() == expected["state_dict"], what


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_schedule_equals_deepspeed_step_by_step(name: str) -> None:
    case = ACCEPTED[name]
    optimizer, scheduler = build(case)
    got = snapshot(optimizer, scheduler)
    for key in ("lrs", "betas", "last_lr"):
        assert_same(got[key], case["construction"][key], f"{name} construction {key}")
    for i, expected in enumerate(case["steps"]):
        scheduler.step()
        assert_step(optimizer, scheduler, expected, f"{name} step {i + 1}")


@pytest.mark.parametrize("name", sorted(ACCEPTED))
@pytest.mark.parametrize("saved_at", [0, 1, 9, 26])
def test_schedule_resumed_from_state_dict_continues_uninterrupted(name: str, saved_at: int) -> None:
    """Save after `saved_at` steps, rebuild over a fresh optimizer, load: the optimizer holds the
    lrs (and betas) of the uninterrupted run at once, and every later step equals DeepSpeed's."""
    case = ACCEPTED[name]
    optimizer, scheduler = build(case)
    for _ in range(saved_at):
        scheduler.step()
    state = json.loads(json.dumps(scheduler.state_dict()))  # as a checkpoint would carry it

    optimizer, scheduler = build(case)
    scheduler.load_state_dict(state)
    # A schedule built with `last_batch_iteration` >= 0 writes nothing at construction (as
    # DeepSpeed's), so there is nothing to restore before its first step.
    if saved_at or "last_batch_iteration" not in case["params"]:
        expected = case["steps"][saved_at - 1] if saved_at else case["construction"]
        got = snapshot(optimizer, scheduler)
        for key in ("lrs", "betas"):
            assert_same(got[key], expected[key], f"{name} right after load at {saved_at}: {key}")
    for i, expected in enumerate(case["steps"][saved_at:], start=saved_at):
        scheduler.step()
        assert_step(optimizer, scheduler, expected, f"{name} resumed at {saved_at}, step {i + 1}")


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_configs_deepspeed_refuses_are_value_errors_naming_the_key(name: str) -> None:
    case = REFUSED[name]
    optimizer = make_optimizer("adamw", [0.1])
    with pytest.raises(ValueError) as info:
        build_scheduler({"type": case["type"], "params": dict(case["params"])}, optimizer)
    assert case["key"] in str(info.value), (case["key"], str(info.value))


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        (
            {"type": "WarmupLR", "params": {"warmup_num_step": 10}},
            "did you mean 'warmup_num_steps'",
        ),
        ({"type": "WarmupLr", "params": {}}, "did you mean 'WarmupLR'"),
        ({"type": "warmuplr"}, "did you mean 'WarmupLR'"),
        ({"type": "WarmupLR", "params": {"warmup_type": "linaer"}}, "'log' or 'linear'"),
        ({"type": "WarmupDecayLR", "params": {"total_num_steps": -1}}, "total_num_steps"),
        ({"type": "WarmupDecayLR", "params": {"total_num_steps": 10.5}}, "total_num_steps"),
        ({"type": "WarmupLR", "params": {"warmup_min_lr": -1e-3}}, "warmup_min_lr"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-3}}, "cycle_max_lr"),
        (
            {
                "type": "OneCycle",
                "params": {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_first_stair_count": -2},
            },
            "cycle_first_stair_count",
        ),
        ({"type": "LRRangeTest", "params": {"last_batch_iteration": -3}}, "last_batch_iteration"),
        ({"type": "WarmupLR", "parms": {}}, "did you mean 'params'"),
        ({"type": "WarmupLR", "params": [1, 2]}, "keyword arguments"),
        ({"params": {}}, "needs a 'type'"),
        ({"type": "StepLR", "params": {"step_sise": 3}}, "did you mean 'step_size'"),
    ],
)
def test_bad_scheduler_config_is_a_value_error_naming_the_fix(section: dict, needle: str) -> None:
    optimizer = make_optimizer("adamw", [0.1])
    with pytest.raises(ValueError) as info:
        build_scheduler(section, optimizer)
    assert needle in str(info.value), str(info.value)


def test_json_integral_float_total_steps_is_accepted() -> None:
    """JSON `1e2` is a float: the same schedule as the integer 100."""
    lrs = []
    for total in (100, 1e2):
        optimizer = make_optimizer("adamw", [0.1])
        scheduler = build_scheduler(
            {"type": "WarmupDecayLR", "params": {"total_num_steps": total, "warmup_num_steps": 5}},
            optimizer,
        )
        lrs.append([(scheduler.step(), scheduler.get_last_lr()[0])[1] for _ in range(30)])
    assert lrs[0] == lrs[1]


def test_torch_scheduler_by_name_is_built_with_its_params() -> None:
    optimizer = make_optimizer("adamw", [0.1])
    scheduler = build_scheduler(
        {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}, optimizer
    )
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr() == [0.1 * 0.25]


def test_schedule_writes_through_a_wrapper_holding_the_optimizer() -> None:
    """DeepSpeed accepts an object whose `.optimizer` is the torch optimizer (ZeRO's wrappers)."""
    inner = make_optimizer("adamw", [0.1])

    class Wrapper:
        optimizer = inner

    scheduler = WarmupLR(Wrapper(), warmup_max_lr=1e-3, warmup_num_steps=4, warmup_type="linear")
    scheduler.step()
    scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.25e-3, rel=1e-12)


def test_tensor_lr_is_filled_in_place() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([param], lr=torch.tensor(0.1))
    lr_tensor = optimizer.param_groups[0]["lr"]
    scheduler = OneCycle(optimizer, cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=4)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] is lr_tensor
    assert lr_tensor.item() == pytest.approx(1e-3 + 9e-3 * 0.25, rel=1e-6)


def test_load_state_dict_refuses_a_foreign_dict() -> None:
    optimizer = make_optimizer("adamw", [0.1])
    scheduler = WarmupLR(optimizer)
    with pytest.raises(ValueError, match="last_batch_iteration"):
        scheduler.load_state_dict({"last_epoch": 3})
