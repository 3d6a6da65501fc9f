"""`FlopsProfilerConfig` (DeepSpeed's `flops_profiler` section) and `StepProfiler`, the entry
point an engine calls around each step.

```python
cfg = profiler.FlopsProfilerConfig.from_section(ds_config["flops_profiler"])
steps = profiler.StepProfiler(model, cfg)
for step, batch in enumerate(batches):
    with steps.step(step):  # profiles only step == cfg.profile_step
        train_step(batch)
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from rich.console import Console
from torch import nn

from minispeed.core.config import field_error
from minispeed.core.files import atomic_write
from minispeed.core.sections import Section, Unsupported, ds_only, key
from minispeed.profiler.flops_profiler import FlopsProfiler
from minispeed.profiler.report import Profile

__all__ = ["FlopsProfilerConfig", "StepProfiler"]


@dataclass(frozen=True)
class FlopsProfilerConfig(Section):
    """When and how to profile one step (DeepSpeed section `flops_profiler`; build it directly
    or with `from_section`)."""

    ds_path: ClassVar[str] = "flops_profiler"
    # At DeepSpeed's default the key changes nothing, so it loads.
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "recompute_fwd_factor": ds_only(
            0.0,
            "minispeed measures recomputation under activation checkpointing instead of "
            "assuming a factor",
        ),
    }

    enabled: bool = key("enabled", False)
    """Profile at all."""
    profile_step: int = key("profile_step", 1)
    """Which step (0-based, as the engine counts) to profile; step 0 is often a warm-up."""
    module_depth: int = key("module_depth", -1)
    """Levels of the module tree printed below the model (-1: all)."""
    top_modules: int = key("top_modules", 1)
    """Children printed per module, those with the most FLOPs first (-1: all)."""
    detailed: bool = key("detailed", True)
    """Print the module tree; False prints the totals line only."""
    output_file: str | None = key("output_file", None)
    """Where to write the profile: `*.json` gets `Profile.to_json()`, anything else the table
    as text; None prints it to the terminal."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.profile_step < 0:
            raise field_error(self, "profile_step", f"must be >= 0, got {self.profile_step}")
        for name in ("module_depth", "top_modules"):
            value = getattr(self, name)
            if value < -1 or (value == 0 and name == "top_modules"):
                raise field_error(self, name, f"must be -1 (all) or a positive count, got {value}")


class StepProfiler:
    """Profiles the configured step of a training loop and reports it (config `output_file`):
    the model's forward, as DeepSpeed's engine profile, and the model's backward, not the loop's
    own work (the optimizer's step, the loss, ZeRO's gradient bookkeeping and gradient hooks:
    Note [the model's forward and backward] in `flops_profiler.py`)."""

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
        prof = FlopsProfiler(
            self.model, peak_flops_per_s=self.peak_flops_per_s, outside_model=False
        )
        with prof:
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
