"""`deepspeed.runtime.lr_schedules`: the schedulers of `minispeed.engine.lr_schedules`, with
DeepSpeed's signatures and step-by-step values (tests/engine/test_lr_schedules.py)."""

from minispeed.engine.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

__all__ = ["LRRangeTest", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
