"""Curriculum learning's difficulty schedule: how hard the samples of step `t` may be.

```python
schedule = CurriculumSchedule.from_ds_config({
    "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 20, "difficulty_step": 8},
})
schedule.difficulty(3)          # 16: the sequence length step 3 may use
```

A curriculum trains on easy samples first (for Megatron-style GPT pre-training: short
sequences, the `seqlen` metric) and raises the difficulty step by step to its maximum. The
schedule is a pure function of the step, with DeepSpeed 0.19.8's values
(`deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler`, recorded in
tests/engine/fixtures/ds_curriculum.json by scripts/record_ds_curriculum.py). With
`m = min_difficulty`, `M = max_difficulty`, `T = total_curriculum_step`, `s = difficulty_step`:

| `schedule_type` | `difficulty(t)` |
|---|---|
| `fixed_linear` | `d = floor((t / T) * (M - m) + m)`, rounded down to a multiple of `s`, raised to the first multiple of `s` at or above `m`, capped at `M` |
| `fixed_root` | the same with `(t / T) ** (1 / root_degree)` |
| `fixed_discrete` | `difficulty[i]` for the first `i` with `t <= max_step[i]`; `difficulty[-1]` past the last |
| `custom` | the function given to `with_custom` (`CurriculumScheduler.set_custom_get_difficulty`) |

`update(current, t)` is the scheduler's running value, DeepSpeed's rule: it follows
`difficulty(t)` while `current < M` and stays put once it reaches `M`.

DeepSpeed 0.19.8 keeps this class for its data-efficiency sampler only: it removed the legacy
top-level `curriculum_learning` section (which passed `curriculum_seqlen=` to the model's
forward), and refuses that section at every value; so does minispeed, unless it is disabled
(docs/engine/config-reference.md). A script that truncates its own batches calls the schedule
itself (docs/engine/migration.md, "Megatron-DeepSpeed's legacy sections").

Cost: O(1) per step for the fixed schedules, O(len(max_step)) for `fixed_discrete`; nothing
on the device.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from minispeed.core.config import ConfigError
from minispeed.core.logging import warn_once

__all__ = ["CurriculumSchedule", "ScheduleType"]


class ScheduleType(enum.StrEnum):
    """How the difficulty rises with the step (the module docstring's table)."""

    FIXED_LINEAR = "fixed_linear"
    FIXED_ROOT = "fixed_root"
    FIXED_DISCRETE = "fixed_discrete"
    CUSTOM = "custom"


# The schedule_config keys each type needs (DeepSpeed's names).
_NEEDS: dict[ScheduleType, tuple[str, ...]] = {
    ScheduleType.FIXED_LINEAR: ("total_curriculum_step", "difficulty_step"),
    ScheduleType.FIXED_ROOT: ("total_curriculum_step", "difficulty_step", "root_degree"),
    ScheduleType.FIXED_DISCRETE: ("difficulty", "max_step"),
    ScheduleType.CUSTOM: (),
}


@dataclass(frozen=True)
class CurriculumSchedule:
    """A difficulty schedule (the module docstring); built from DeepSpeed's dict by
    `from_ds_config`."""

    min_difficulty: int
    """The difficulty of the first steps (`m`)."""
    max_difficulty: int
    """The difficulty the schedule ends at and never exceeds (`M`; `fixed_discrete` and
    `custom` may go past it, as DeepSpeed's do)."""
    schedule_type: ScheduleType
    """Which rule (`ScheduleType`)."""
    total_curriculum_step: int | None = None
    """`fixed_linear` / `fixed_root`: the step at which the difficulty reaches `M` (`T`)."""
    difficulty_step: int | None = None
    """`fixed_linear` / `fixed_root`: every difficulty is a multiple of it (`s`; 8 keeps fp16
    sequence lengths on tensor-core shapes)."""
    root_degree: float | None = None
    """`fixed_root`: 2 is a square root (fast start), 1 is linear."""
    difficulties: tuple[int, ...] = ()
    """`fixed_discrete`: the difficulties in order (`schedule_config.difficulty`)."""
    max_steps: tuple[int, ...] = ()
    """`fixed_discrete`: the last step of each difficulty but the final one
    (`schedule_config.max_step`, one shorter than `difficulties`)."""
    custom: Callable[[int], int] | None = None
    """`custom`: the step -> difficulty function (`with_custom`)."""

    @classmethod
    def from_ds_config(cls, config: Mapping[str, Any], path: str = "") -> CurriculumSchedule:
        """The schedule of DeepSpeed's curriculum dict (`min_difficulty`, `max_difficulty`,
        `schedule_type`, `schedule_config`); a missing or wrong key is a `ConfigError` naming
        it under `path` (DeepSpeed refuses the same configs, with bare assertions)."""

        def where(*keys: str) -> str:
            return ".".join(k for k in (path, *keys) if k)

        for name in ("min_difficulty", "max_difficulty", "schedule_type"):
            if name not in config:
                raise ConfigError(where(name), "curriculum learning requires it: add it")
        try:
            kind = ScheduleType(config["schedule_type"])
        except ValueError:
            known = ", ".join(repr(t.value) for t in ScheduleType)
            raise ConfigError(
                where("schedule_type"), f"is {config['schedule_type']!r}; use one of {known}"
            ) from None
        sub = config.get("schedule_config")
        if _NEEDS[kind] and not isinstance(sub, Mapping):
            raise ConfigError(
                where("schedule_config"),
                f"the {kind.value} schedule requires it, with {', '.join(_NEEDS[kind])}",
            )
        for name in _NEEDS[kind]:
            if name not in sub:
                raise ConfigError(
                    where("schedule_config", name), f"the {kind.value} schedule requires it"
                )
        schedule = cls(config["min_difficulty"], config["max_difficulty"], kind)
        if kind is ScheduleType.FIXED_DISCRETE:
            difficulties, max_steps = tuple(sub["difficulty"]), tuple(sub["max_step"])
            if not max_steps or len(difficulties) != len(max_steps) + 1:
                raise ConfigError(
                    where("schedule_config"),
                    f"has {len(difficulties)} difficulties and {len(max_steps)} max_step "
                    "entries: give one max_step per difficulty but the last (which holds for "
                    "every later step), at least one",
                )
            return replace(schedule, difficulties=difficulties, max_steps=max_steps)
        if kind is ScheduleType.CUSTOM:
            return schedule
        if sub["difficulty_step"] % 8 != 0:
            warn_once(
                f"{where('schedule_config', 'difficulty_step')} is {sub['difficulty_step']}: "
                "sequence lengths that are multiples of 8 (fp16) or 16 (int8) keep tensor cores "
                "busy; ignore this unless the difficulty is a sequence length"
            )
        return replace(
            schedule,
            total_curriculum_step=sub["total_curriculum_step"],
            difficulty_step=sub["difficulty_step"],
            root_degree=sub.get("root_degree"),
        )

    def with_custom(self, function: Callable[[int], int]) -> CurriculumSchedule:
        """This schedule with `function` as its `custom` rule."""
        return replace(self, custom=function)

    def difficulty(self, step: int) -> int:
        """The difficulty at global step `step` (the module docstring's table)."""
        if self.schedule_type is ScheduleType.FIXED_DISCRETE:
            for difficulty, last in zip(self.difficulties, self.max_steps, strict=False):
                if step <= last:
                    return difficulty
            return self.difficulties[-1]
        if self.schedule_type is ScheduleType.CUSTOM:
            if self.custom is None:
                raise RuntimeError(
                    "the custom curriculum schedule has no function: give it one "
                    "(CurriculumScheduler.set_custom_get_difficulty) before the first step"
                )
            return self.custom(step)
        degree = 1 if self.schedule_type is ScheduleType.FIXED_LINEAR else self.root_degree
        m, big_m, s = self.min_difficulty, self.max_difficulty, self.difficulty_step
        fraction = (float(step) / self.total_curriculum_step) ** (1.0 / degree)
        d = math.floor(fraction * (big_m - m) + m)
        d -= d % s
        # Rounding down to a multiple of s can fall below m (m = 8, s = 16 gives 0): DeepSpeed
        # raises it to the first multiple of s at or above m, then caps it at M.
        return min(max(d, -(-m // s) * s), big_m)

    def update(self, current: int, step: int) -> int:
        """The running difficulty after step `step` from `current`: `difficulty(step)` while
        `current < max_difficulty`, else `current` (DeepSpeed's `update_difficulty`)."""
        return self.difficulty(step) if current < self.max_difficulty else current
