"""Megatron-DeepSpeed's legacy sections DeepSpeed 0.19.8 removed and minispeed keeps with DeepSpeed
0.17.6's meaning: the keyword arguments the engine adds to a training forward.

```python
cfg = EngineConfig.from_ds_config({..., "progressive_layer_drop":
                                   {"enabled": True, "theta": 0.5, "gamma": 0.001}})
engine(tokens)   # the module's forward gets progressive_layer_drop=True, pld_theta=...
engine.get_pld_theta()
```

- `progressive_layer_drop` (`LayerDropConfig`): the engine adds `progressive_layer_drop=True,
  pld_theta=theta(t)` to every forward in training mode; the model decides what to drop
  (Megatron-DeepSpeed's BERT keeps each layer with that probability). With `p = theta`,
  `g = gamma` and `t` the optimizer steps taken so far, 0.17.6's schedule (its
  `ProgressiveLayerDrop` is updated at each boundary with the step count before the step):
  `theta(0) = 1`, `theta(t) = (1 - p) e^(-g (t - 1)) + p` for `t >= 1`.
- `curriculum_learning` with `curriculum_type: "seqlen"` (`LegacyCurriculumConfig`): the engine
  adds `curriculum_seqlen=L` to every forward in training mode, the model truncates; `L` is the
  schedule's running difficulty, updated at every training forward with step `t + 1`
  (`CurriculumSchedule.update`: its table in minispeed.engine.curriculum).

`ForwardArguments` holds the running difficulty (the one piece of state); the engine asks it
for the arguments of each training forward, and answers it as `engine.curriculum_scheduler_legacy`
(`set_custom_get_difficulty(fn)` for the `custom` schedule, `get_current_difficulty()`). In eval mode nothing is added, as in 0.17.6.
Recorded against DeepSpeed 0.17.6 by scripts/record_ds_legacy.py.

Cost: one dict merge and O(1) arithmetic per forward (`O(len(max_step))` for `fixed_discrete`);
nothing on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from minispeed.core.config import ConfigError
from minispeed.engine.curriculum import CurriculumSchedule

__all__ = ["ForwardArguments", "LayerDropConfig", "LegacyCurriculumConfig"]


def _section(config: Any, path: str, known: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(config, Mapping):
        raise ConfigError(path, f"is {config!r}; give an object with {', '.join(known)}")
    for name in config:
        if name not in known:
            raise ConfigError(f"{path}.{name}", f"is not a key of {path}; use {', '.join(known)}")
    return config


@dataclass(frozen=True)
class LayerDropConfig:
    """DeepSpeed 0.17.6's `progressive_layer_drop` section (the module docstring)."""

    enabled: bool = False
    """Add `progressive_layer_drop=True, pld_theta=...` to every training forward."""
    theta: float = 1.0
    """`p`, the keep probability the schedule decays to (required when enabled)."""
    gamma: float = 0.001
    """`g`, how fast theta decays per optimizer step (required when enabled)."""

    @classmethod
    def from_ds_config(cls, config: Any, path: str = "progressive_layer_drop") -> LayerDropConfig:
        """The section as DeepSpeed 0.17.6 reads it; an unknown key or a theta outside (0, 1]
        is a `ConfigError` naming it."""
        config = _section(config, path, ("enabled", "theta", "gamma"))
        if config.get("enabled", False):
            for name in ("theta", "gamma"):
                if name not in config:  # DeepSpeed 0.17.6 fails with a bare KeyError
                    raise ConfigError(
                        f"{path}.{name}", "progressive layer drop requires it: add it"
                    )
        out = cls(**config)
        if out.enabled and not 0.0 < out.theta <= 1.0:
            raise ConfigError(
                f"{path}.theta", f"is {out.theta}; a keep probability in (0, 1] (0.5 is usual)"
            )
        return out

    def theta_at(self, steps: int) -> float:
        """`pld_theta` after `steps` optimizer steps (the module docstring's formula)."""
        if steps == 0:
            return 1.0
        return (1.0 - self.theta) * math.exp(-self.gamma * (steps - 1)) + self.theta


@dataclass(frozen=True)
class LegacyCurriculumConfig:
    """DeepSpeed 0.17.6's legacy top-level `curriculum_learning` section (the module
    docstring); only `curriculum_type: "seqlen"` changes the forward (0.17.6's engine adds
    nothing for another type), and it is the only type accepted."""

    enabled: bool = False
    """Add `curriculum_seqlen=...` to every training forward."""
    schedule: CurriculumSchedule | None = None
    """The difficulty schedule (`min_difficulty`, `max_difficulty`, `schedule_type`,
    `schedule_config`: minispeed.engine.curriculum)."""

    @classmethod
    def from_ds_config(
        cls, config: Any, path: str = "curriculum_learning"
    ) -> LegacyCurriculumConfig:
        """The section as DeepSpeed 0.17.6 reads it; a missing or wrong key is a `ConfigError`
        naming it."""
        keys = ("enabled", "curriculum_type", "min_difficulty", "max_difficulty",
                "schedule_type", "schedule_config")  # fmt: skip
        config = _section(config, path, keys)
        if not config.get("enabled", False):
            return cls()
        kind = config.get("curriculum_type")
        if kind != "seqlen":
            raise ConfigError(
                f"{path}.curriculum_type",
                f"is {kind!r}; minispeed keeps DeepSpeed 0.17.6's 'seqlen' curriculum only (the "
                "engine passes curriculum_seqlen= to the forward; other types changed nothing "
                "there): set it to 'seqlen', or take difficulties from CurriculumScheduler in "
                "your loop",
            )
        return cls(True, CurriculumSchedule.from_ds_config(config, path))


class ForwardArguments:
    """The keyword arguments the engine adds to each training forward (the module docstring);
    built once at set-up, when either section is enabled."""

    def __init__(self, layer_drop: LayerDropConfig, curriculum: LegacyCurriculumConfig) -> None:
        self.layer_drop = layer_drop
        self.schedule = curriculum.schedule if curriculum.enabled else None
        # DeepSpeed's CurriculumScheduler starts at min_difficulty.
        self.seqlen = None if self.schedule is None else self.schedule.min_difficulty

    def set_custom_get_difficulty(self, function: Callable[[int], int]) -> None:
        """The `custom` schedule's step -> length function (DeepSpeed 0.17.6's
        `engine.curriculum_scheduler_legacy.set_custom_get_difficulty`); before the first
        training forward."""
        if self.schedule is None:
            raise RuntimeError(
                "set_custom_get_difficulty needs the curriculum_learning section enabled"
            )
        self.schedule = self.schedule.with_custom(function)

    def get_current_difficulty(self) -> int | None:
        """The sequence length the last training forward got (min_difficulty before any)."""
        return self.seqlen

    def __call__(self, steps: int) -> dict[str, Any]:
        """The arguments of a training forward after `steps` optimizer steps (updates the
        running sequence length with step `steps + 1`, as 0.17.6's engine does per forward)."""
        out: dict[str, Any] = {}
        if self.layer_drop.enabled:
            out["progressive_layer_drop"] = True
            out["pld_theta"] = self.layer_drop.theta_at(steps)
        if self.schedule is not None:
            self.seqlen = self.schedule.update(self.seqlen, steps + 1)
            out["curriculum_seqlen"] = self.seqlen
        return out
