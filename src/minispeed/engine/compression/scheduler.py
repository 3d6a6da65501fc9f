"""`deepspeed.compression.scheduler`: `compression_scheduler(model, compression_config)`, the
object DeepSpeed's engine steps; here `minispeed.compression.Schedule`, which the engine builds
from the config itself (a script rarely builds one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from minispeed import compression

__all__ = ["compression_scheduler"]


class compression_scheduler(compression.Schedule):
    """`Schedule` built from the `compression_training` section (a dict) as DeepSpeed's is;
    `step(step_zero_check=True)` re-applies the current step without advancing."""

    def __init__(self, model: nn.Module, compression_config: Mapping[str, Any]) -> None:
        super().__init__(model, compression.CompressionConfig.from_ds_config(compression_config))

    def step(self, step_zero_check: bool = False) -> None:  # type: ignore[override]
        """Advance one applied optimizer step (`step_zero_check`: apply the current one only)."""
        if step_zero_check:
            self._apply()
        else:
            super().step()
