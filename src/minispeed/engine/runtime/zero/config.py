"""`deepspeed.runtime.zero.config`: DeepSpeed's ZeRO config model over `minispeed.zero.ZeroConfig`.

```python
from minispeed.engine.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
cfg = DeepSpeedZeroConfig(**ds_config["zero_optimization"])     # was: deepspeed.runtime....
cfg.stage == ZeroStageEnum.weights, cfg.prefetch_bucket_size, cfg.offload_param.device
```

`DeepSpeedZeroConfig(**section)` checks a `zero_optimization` section with
`ZeroConfig.from_section` (the one key checker: an unknown key is a `ConfigError` naming it and
the nearest key) and answers every key ZeRO reads by DeepSpeed's field name, with the value
minispeed applies: `stage` a `ZeroStageEnum`; the `stage3_` keys without the prefix
(`prefetch_bucket_size`, `param_persistence_threshold`, `max_live_parameters`,
`max_reuse_distance`, `gather_16bit_weights_on_model_save`), which, as DeepSpeed's, are also
accepted as arguments by those names; `offload_param` / `offload_optimizer` DeepSpeed's offload
models (`offload_config`) where the section has them, else `None`. One default differs from
DeepSpeed's on purpose: `overlap_comm` left out is on except at stage 2 (DeepSpeed: at stage 3
only; Note [overlap_comm's default] in minispeed.zero.config). DeepSpeed's fields ZeRO does not
read raise an `AttributeError` saying so. `minispeed` attribute: the `ZeroConfig` itself.
Cost: the section's checks.
"""

from __future__ import annotations

import enum
from typing import Any

from minispeed.engine.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
    _Model,
    ds_fields,
)

__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "ZeroStageEnum",
]


class ZeroStageEnum(int, enum.Enum):
    """DeepSpeed's ZeRO stages (`max_stage` is `weights`, as DeepSpeed's)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


# DeepSpeed's field names for the keys it reads under a `stage3_` alias (the last four are
# keys minispeed accepts at DeepSpeed's default only).
_RENAMED = {
    f"stage3_{name}": name
    for name in (
        "prefetch_bucket_size",
        "param_persistence_threshold",
        "max_live_parameters",
        "max_reuse_distance",
        "gather_16bit_weights_on_model_save",
        "allgather_sequential",
        "use_all_reduce_for_fetch_params",
        "model_persistence_threshold",
        "module_granularity_threshold",
    )
}
_KEY_OF = {field: key for key, field in _RENAMED.items()}
_OFFLOAD = {
    "offload_param": DeepSpeedZeroOffloadParamConfig,
    "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
}


class DeepSpeedZeroConfig(_Model):
    """DeepSpeed's `zero_optimization` model: `minispeed.zero.ZeroConfig` (module docstring)."""

    def __init__(self, **section: Any) -> None:
        from minispeed.zero import ZeroConfig

        section = {_KEY_OF.get(k, k): v for k, v in section.items()}
        cfg = ZeroConfig.from_section(section)
        fields = ds_fields(cfg, _RENAMED)
        fields["stage"] = ZeroStageEnum(cfg.stage)
        for name, model in _OFFLOAD.items():
            given = section.get(name)
            fields[name] = None if given is None else model(**given)
        super().__init__(cfg, fields)
