"""`deepspeed.runtime.config`: `DeepSpeedConfig` (a ds_config read and resolved, as DeepSpeed's
engine holds it) and `DeepSpeedConfigError`, over `minispeed.engine.config.EngineConfig`.

```python
from minispeed.engine.runtime.config import DeepSpeedConfig   # was: deepspeed.runtime.config
cfg = DeepSpeedConfig("ds_config.json")         # the batch triple resolved over the world size
cfg.train_batch_size, cfg.zero_optimization_stage, cfg.zero_config.offload_optimizer
```

`DeepSpeedConfig(config, mpu=None, mesh_device=None)` checks every key as `initialize` does
and answers DeepSpeed's attribute names; `mpu` is read for its data-parallel world size only
(`get_data_parallel_world_size()`), as DeepSpeed's pipeline engine hands its grid; without one
the data-parallel size is the world's (1 before the process group exists). `zero_config` is
minispeed's `ZeroConfig` (its own field names, `docs/engine/config-reference.md`), and
`_param_dict` the dict as given. `DeepSpeedConfigError` is minispeed's `ConfigError` (a
`ValueError` carrying the key path), so `except DeepSpeedConfigError` catches every config
error the engine raises. Cost: the config's checks, no collective.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

import minispeed.comm as comm
from minispeed.core.config import ConfigError
from minispeed.engine.config import EngineConfig, load_ds_config

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]

DeepSpeedConfigError = ConfigError


class DeepSpeedConfig:
    """A ds_config checked and resolved (module docstring); attributes are DeepSpeed's names."""

    def __init__(
        self,
        config: str | os.PathLike | Mapping[str, Any],
        mpu: Any = None,
        mesh_device: Any = None,
    ) -> None:
        if mesh_device is not None:
            raise ConfigError(
                "", "DeepSpeedConfig(mesh_device=...) is not supported by minispeed; leave it None"
            )
        if mpu is not None:
            data = int(mpu.get_data_parallel_world_size())
        else:
            data = comm.get_world_size() if comm.is_initialized() else 1
        self._param_dict = load_ds_config(config)
        self._engine_config = EngineConfig.from_ds_config(self._param_dict, data_parallel_size=data)
        self.world_size = data

    @property
    def train_batch_size(self) -> int:
        return self._engine_config.train_batch_size

    @property
    def train_micro_batch_size_per_gpu(self) -> int:
        return self._engine_config.micro_batch_size

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._engine_config.gradient_accumulation_steps

    @property
    def zero_config(self) -> Any:
        return self._engine_config.zero

    @property
    def zero_optimization_stage(self) -> int:
        return self._engine_config.zero.stage

    @property
    def zero_enabled(self) -> bool:
        return self._engine_config.zero.stage > 0

    @property
    def gradient_clipping(self) -> float:
        return self._engine_config.zero.max_grad_norm

    @property
    def fp16_enabled(self) -> bool:
        return self._engine_config.precision.param_dtype == torch.float16

    @property
    def bfloat16_enabled(self) -> bool:
        return self._engine_config.precision.param_dtype == torch.bfloat16

    @property
    def optimizer_name(self) -> str | None:
        section = self._engine_config.optimizer
        return None if section is None else section.type.lower()

    @property
    def optimizer_params(self) -> dict[str, Any] | None:
        section = self._engine_config.optimizer
        return None if section is None else dict(section.params)

    @property
    def scheduler_name(self) -> str | None:
        section = self._engine_config.scheduler
        return None if section is None else section.type

    @property
    def scheduler_params(self) -> dict[str, Any] | None:
        section = self._engine_config.scheduler
        return None if section is None else dict(section.params)

    @property
    def steps_per_print(self) -> int | None:
        return self._engine_config.steps_per_print

    @property
    def wall_clock_breakdown(self) -> bool:
        return self._engine_config.wall_clock_breakdown
