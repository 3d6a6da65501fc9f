"""DeepSpeed's `deepspeed.runtime` import path: `lr_schedules`, whose classes scripts construct
themselves (`from deepspeed.runtime.lr_schedules import WarmupLR`), and `zero`'s memory
estimators (`from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live`)."""
