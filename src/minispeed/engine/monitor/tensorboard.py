"""`deepspeed.monitor.tensorboard`: `TensorBoardMonitor` of `minispeed.profiler.monitor`."""

from minispeed.profiler.monitor import TensorBoardMonitor

__all__ = ["TensorBoardMonitor"]
