"""`deepspeed.monitor.monitor`: `MonitorMaster(monitor_config)`, DeepSpeed's signature over
`minispeed.profiler.monitor.MonitorMaster` (which takes the rank; this one asks the process
group, as DeepSpeed's does)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import minispeed.comm as comm
from minispeed.profiler import monitor as _monitor
from minispeed.profiler.monitor import (
    CometMonitor,
    CsvMonitor,
    Event,
    MonitorConfig,
    TensorBoardMonitor,
    WandbMonitor,
)

csvMonitor = CsvMonitor  # DeepSpeed's name

__all__ = [
    "CometMonitor",
    "Monitor",
    "MonitorMaster",
    "TensorBoardMonitor",
    "WandbMonitor",
    "csvMonitor",
]


class Monitor(ABC):
    """DeepSpeed's base of a monitor, for a client's own: keeps its config, writes events."""

    @abstractmethod
    def __init__(self, monitor_config: Any) -> None:
        self.monitor_config = monitor_config

    @abstractmethod
    def write_events(self, event_list: Sequence[Event]) -> None:
        """Write each `(name, value, step)`."""


class MonitorMaster(_monitor.MonitorMaster):
    """Every enabled monitor of `monitor_config` (`deepspeed.monitor.config.get_monitor_config`
    or `engine.monitor.config`), written on global rank 0 only."""

    def __init__(self, monitor_config: MonitorConfig) -> None:
        super().__init__(monitor_config, rank=comm.get_rank())
