"""DeepSpeed's `deepspeed.runtime` import path: only `lr_schedules`, whose classes scripts
construct themselves (`from deepspeed.runtime.lr_schedules import WarmupLR`)."""
