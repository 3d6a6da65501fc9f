"""`deepspeed.compression.compress`: DeepSpeed's compression calls over `minispeed.compression`.

```python
from deepspeed.compression.compress import init_compression, redundancy_clean
model = init_compression(model, ds_config)            # before deepspeed.initialize
engine, *_ = deepspeed.initialize(model=model, config=ds_config)
...                                                    # train: the engine's schedule
model = redundancy_clean(model, ds_config)            # the smaller model
```

`ds_config` is the dict or the path of the ds_config.json (its `compression_training` section
is read; the rest is ignored here). `mpu=` (Megatron's row/column-parallel layers) is refused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from minispeed import compression
from minispeed.engine.config import load_ds_config

__all__ = ["init_compression", "redundancy_clean", "student_initialization"]


def _section(
    deepspeed_config: str | os.PathLike | Mapping[str, Any],
) -> compression.CompressionConfig:
    ds = load_ds_config(deepspeed_config)
    return compression.CompressionConfig.from_ds_config(ds.get("compression_training"))


def _no_mpu(mpu: Any) -> None:
    if mpu is not None:
        raise NotImplementedError(
            "mpu= (Megatron's parallel linears) is not supported by minispeed.compression: "
            "compress the model before tensor parallelism (tensor_parallel.autotp_size)"
        )


def init_compression(
    model: nn.Module,
    deepspeed_config: str | os.PathLike | Mapping[str, Any],
    teacher_model: nn.Module | None = None,
    mpu: Any = None,
) -> nn.Module:
    """Compress `model` in place for training (`minispeed.compression.compress`); returns it."""
    _no_mpu(mpu)
    return compression.compress(model, _section(deepspeed_config), teacher_model)


def redundancy_clean(
    model: nn.Module, deepspeed_config: str | os.PathLike | Mapping[str, Any], mpu: Any = None
) -> nn.Module:
    """Make compression permanent, shrinking pruned layers (`minispeed.compression.clean`)."""
    _no_mpu(mpu)
    return compression.clean(model, _section(deepspeed_config))


def student_initialization(
    student_model: nn.Module,
    teacher_model: nn.Module,
    deepspeed_config: str | os.PathLike | Mapping[str, Any],
) -> None:
    """Layer reduction's student from its teacher (`minispeed.compression.init_student`)."""
    reduction = _section(deepspeed_config).layer_reduction
    compression.init_student(student_model, teacher_model, reduction)
