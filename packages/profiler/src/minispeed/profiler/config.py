"""`FlopsProfilerConfig` (DeepSpeed's `flops_profiler` section) and `StepProfiler`, the entry
point an engine calls around each step.

```python
cfg = profiler.FlopsProfilerConfig.from_ds_config(ds_config["flops_profiler"])
steps = profiler.StepProfiler(model, cfg)
for step, batch in enumerate(batches):
    with steps.step(step):  # profiles only step == cfg.profile_step
        train_step(batch)
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from torch import nn

from minispeed.core.config import check_keys
from minispeed.core.files import atomic_write
from minispeed.profiler.flops_profiler import FlopsProfiler
from minispeed.profiler.report import Profile

__all__ = ["FlopsProfilerConfig", "StepProfiler"]

_DS_KEYS = {
    "enabled": "enabled",
    "profile_step": "profile_step",
    "module_depth": "module_depth",
    "top_modules": "top_modules",
    "detailed": "detailed",
    "output_file": "output_file",
}
_REFUSED = {
    "recompute_fwd_factor": "minispeed measures recomputation under activation checkpointing "
    "instead of assuming a factor; remove the key",
}
# DeepSpeed's value of each refused key: at its default the key changes nothing, so it loads.
_DS_DEFAULTS = {"recompute_fwd_factor": 0.0}


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """When and how to profile one step."""

    enabled: bool = False
    """Profile at all."""
    profile_step: int = 1
    """Which step (0-based, as the engine counts) to profile; step 0 is often a warm-up."""
    module_depth: int = -1
    """Levels of the module tree printed below the model (-1: all)."""
    top_modules: int = 1
    """Children printed per module, those with the most FLOPs first (-1: all)."""
    detailed: bool = True
    """Print the module tree; False prints the totals line only."""
    output_file: str | None = None
    """Where to write the profile: `*.json` gets `Profile.to_json()`, anything else the table
    as text; None prints it to the terminal."""

    def __post_init__(self) -> None:
        if self.profile_step < 0:
            raise ValueError(f"flops_profiler.profile_step must be >= 0, got {self.profile_step}")
        for name in ("module_depth", "top_modules"):
            value = getattr(self, name)
            if value < -1 or (value == 0 and name == "top_modules"):
                raise ValueError(
                    f"flops_profiler.{name} must be -1 (all) or a positive count, got {value}"
                )

    @classmethod
    def from_ds_config(cls, section: Mapping[str, Any] | None) -> FlopsProfilerConfig:
        """Translate DeepSpeed's `flops_profiler` section; unknown keys are errors."""
        section = dict(section or {})
        check_keys(
            section,
            _DS_KEYS,
            "flops_profiler",
            unsupported=_REFUSED,
            defaults={key: _DS_DEFAULTS[key] for key in _REFUSED},
        )
        section = {k: v for k, v in section.items() if k in _DS_KEYS}
        return cls(**{_DS_KEYS[k]: v for k, v in section.items()})


class StepProfiler:
    """Profiles the configured step of a training loop and reports it (config `output_file`)."""

    def __init__(
        self,
        model: nn.Module,
        config: FlopsProfilerConfig,
        peak_flops_per_s: float | str | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.peak_flops_per_s = peak_flops_per_s
        self.profile: Profile | None = None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap step number `step`; profiles it if it is `config.profile_step`."""
        if not self.config.enabled or step != self.config.profile_step:
            yield
            return
        with FlopsProfiler(self.model, peak_flops_per_s=self.peak_flops_per_s) as prof:
            yield
        self.profile = prof.result()
        self._report(self.profile)

    def _report(self, profile: Profile) -> None:
        c = self.config
        path = c.output_file
        if path is not None and path.endswith(".json"):
            profile.write_json(path)
            return
        if path is None:
            Console().print(profile.table(c.module_depth, c.top_modules, c.detailed))
            return
        atomic_write(path, profile.render(c.module_depth, c.top_modules, c.detailed))
