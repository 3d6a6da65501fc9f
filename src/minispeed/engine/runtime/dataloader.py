"""`deepspeed.runtime.dataloader`: `RepeatingLoader` (`minispeed.engine.utils`), an endless
iterator over a loader, as pipeline scripts feed `train_batch`. DeepSpeed's own
`DeepSpeedDataLoader` is what `initialize(training_data=...)` returns; minispeed returns a
torch `DataLoader` over a `DistributedSampler` there (`minispeed.engine.initialize`)."""

from minispeed.engine.utils import RepeatingLoader

__all__ = ["RepeatingLoader"]
