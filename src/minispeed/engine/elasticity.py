"""`deepspeed.elasticity` (DeepSpeed 0.17.6's; 0.19.8 removed it): `compute_elastic_config` and
its errors over `minispeed.engine.elastic` (docs/engine/migration.md)."""

from __future__ import annotations

from typing import Any

from minispeed.engine.elastic import (
    ElasticConfig,
    ElasticityConfigError,
    ElasticityError,
    ElasticityIncompatibleWorldSize,
)

__all__ = [
    "ElasticityConfigError",
    "ElasticityError",
    "ElasticityIncompatibleWorldSize",
    "compute_elastic_config",
    "elasticity_enabled",
]


def elasticity_enabled(ds_config: dict) -> bool:
    """Whether `ds_config` holds an enabled `elasticity` section."""
    return bool(ds_config.get("elasticity", {}).get("enabled", False))


def compute_elastic_config(
    ds_config: dict, target_deepspeed_version: str, world_size: int = 0,
    return_microbatch: bool = False,
) -> tuple[Any, ...]:  # fmt: skip
    """`(train_batch_size, valid world sizes)`, with the micro-batch size appended when
    `world_size` is given or `return_microbatch` (`ElasticConfig.compute`)."""
    if not isinstance(ds_config, dict):
        raise ElasticityConfigError("", f"ds_config is a {type(ds_config).__name__}; give a dict")
    if "elasticity" not in ds_config:
        raise ElasticityConfigError("elasticity", "is missing: add the section")
    config = ElasticConfig.from_ds_config(ds_config["elasticity"])
    batch, valid, micro = config.compute(world_size, target_deepspeed_version)
    return (batch, valid, micro) if world_size > 0 or return_microbatch else (batch, valid)
