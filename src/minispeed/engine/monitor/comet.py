"""`deepspeed.monitor.comet`: `CometMonitor` of `minispeed.profiler.monitor`."""

from minispeed.profiler.monitor import CometMonitor, EventsLogScheduler

__all__ = ["CometMonitor", "EventsLogScheduler"]
