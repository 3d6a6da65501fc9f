"""`deepspeed.runtime.dataloader`: `RepeatingLoader` (`minispeed.pipeline`), an endless
iterator over a loader, as pipeline scripts feed `train_batch`. DeepSpeed's own
`DeepSpeedDataLoader` is what `initialize(training_data=...)` returns; minispeed returns a
torch `DataLoader` over a `DistributedSampler` there (`minispeed.engine.initialize`), and for a
pipeline that loader in a `RepeatingLoader`, as DeepSpeed's pipeline engine does."""

from minispeed.engine.utils import RepeatingLoader

__all__ = ["RepeatingLoader"]
