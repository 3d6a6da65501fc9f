"""`deepspeed.runtime`: the engine's class and config (`engine`, `config`), the schedules
(`lr_schedules`), the curriculum schedule (`data_pipeline.curriculum_scheduler`), ZeRO (`zero`), the pipeline's long paths (`pipe`), activation checkpointing's
(`activation_checkpointing`), DeepSpeed-Ulysses' groups (`sequence_parallel.parallel_state_sp`),
`tensor_parallel.tp_model_init` and the helpers scripts import
(`utils`)."""

from minispeed.engine.runtime import (
    activation_checkpointing,
    config,
    data_pipeline,
    dataloader,
    engine,
    lr_schedules,
    pipe,
    sequence_parallel,
    tensor_parallel,
    utils,
    zero,
)

__all__ = [
    "activation_checkpointing",
    "config",
    "data_pipeline",
    "dataloader",
    "engine",
    "lr_schedules",
    "pipe",
    "sequence_parallel",
    "tensor_parallel",
    "utils",
    "zero",
]
