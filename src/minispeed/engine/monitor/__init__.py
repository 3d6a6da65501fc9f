"""`deepspeed.monitor`: DeepSpeed's monitors (TensorBoard, CSV, W&B, Comet) over
`minispeed.profiler.monitor`, where they live; `engine.monitor` is its `MonitorMaster`."""

from minispeed.engine.monitor import comet, config, csv_monitor, monitor, tensorboard, utils, wandb

__all__ = ["comet", "config", "csv_monitor", "monitor", "tensorboard", "utils", "wandb"]
