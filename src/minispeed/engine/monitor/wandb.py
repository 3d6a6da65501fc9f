"""`deepspeed.monitor.wandb`: `WandbMonitor` of `minispeed.profiler.monitor`."""

from minispeed.profiler.monitor import WandbMonitor

__all__ = ["WandbMonitor"]
