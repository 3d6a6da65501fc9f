"""`deepspeed.runtime.data_pipeline`: the curriculum difficulty schedule
(`curriculum_scheduler.CurriculumScheduler`, over `minispeed.engine.curriculum`). DeepSpeed's
data-efficiency sampler and random-LTD (`data_sampling`, `data_routing`) are not provided."""

from minispeed.engine.runtime.data_pipeline import curriculum_scheduler

__all__ = ["curriculum_scheduler"]
