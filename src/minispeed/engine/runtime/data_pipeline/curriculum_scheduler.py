"""`deepspeed.runtime.data_pipeline.curriculum_scheduler`: DeepSpeed's `CurriculumScheduler`
(its constructor, `state`, `get_difficulty`, `update_difficulty`, `set_custom_get_difficulty`)
over `minispeed.engine.curriculum.CurriculumSchedule`, with DeepSpeed 0.19.8's difficulty at
every step (tests/engine/test_curriculum.py)."""

from collections.abc import Callable, Mapping
from typing import Any

from minispeed.engine.curriculum import CurriculumSchedule, ScheduleType

__all__ = ["CurriculumScheduler"]


class CurriculumScheduler:
    """DeepSpeed's curriculum scheduler: `config` is its dict (`min_difficulty`,
    `max_difficulty`, `schedule_type`, `schedule_config`). `state` is DeepSpeed's dict (what
    its data sampler saves): the config's values and `current_difficulty`, the running value
    `update_difficulty` moves; assigning a saved `state` resumes from it."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._schedule = CurriculumSchedule.from_ds_config(config)
        self.state: dict[str, Any] = {
            "min_difficulty": config["min_difficulty"],
            "max_difficulty": config["max_difficulty"],
            "current_difficulty": config["min_difficulty"],
            "schedule_type": config["schedule_type"],
        }
        if self._schedule.schedule_type is not ScheduleType.CUSTOM:
            self.state["schedule_config"] = config["schedule_config"]

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The step -> difficulty function of a `custom` schedule."""
        self._schedule = self._schedule.with_custom(schedule_function)

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at `global_steps`."""
        return self._schedule.difficulty(global_steps)

    def update_difficulty(self, global_steps: int) -> int:
        """Move `state["current_difficulty"]` to `global_steps` and return it (it stays put
        once it reaches `max_difficulty`)."""
        current = self._schedule.update(self.state["current_difficulty"], global_steps)
        self.state["current_difficulty"] = current
        return current
