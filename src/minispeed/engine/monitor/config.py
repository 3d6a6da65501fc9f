"""`deepspeed.monitor.config`: the monitor sections under DeepSpeed's names
(`minispeed.profiler.monitor`), and `get_monitor_config(ds_config)`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from minispeed.profiler.monitor import (
    CometConfig,
    CsvMonitorConfig,
    MonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)

CSVConfig = CsvMonitorConfig

__all__ = [
    "CSVConfig",
    "CometConfig",
    "DeepSpeedMonitorConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "get_monitor_config",
]


def get_monitor_config(param_dict: Mapping[str, Any]) -> MonitorConfig:
    """The `tensorboard`, `wandb`, `csv_monitor` and `comet` sections of a ds_config dict,
    each checked by its class (an unknown key is a `ConfigError` naming it)."""
    return MonitorConfig.from_ds_config(param_dict)


def DeepSpeedMonitorConfig(**sections: Mapping[str, Any]) -> MonitorConfig:
    """DeepSpeed's model of the four sections, built from their dicts by keyword
    (`DeepSpeedMonitorConfig(csv_monitor={"enabled": True})`): a `MonitorConfig`."""
    return MonitorConfig.from_ds_config(sections)
