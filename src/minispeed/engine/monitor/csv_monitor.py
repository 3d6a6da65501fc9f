"""`deepspeed.monitor.csv_monitor`: `csvMonitor`, `minispeed.profiler.monitor.CsvMonitor` under
DeepSpeed's name."""

from minispeed.engine.monitor.monitor import csvMonitor

__all__ = ["csvMonitor"]
