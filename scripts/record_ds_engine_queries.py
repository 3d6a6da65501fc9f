"""DeepSpeed engine's config queries (`engine.zero_cpu_offload()`, `engine.get_batch_info()`, ...)
for three configs, kept as a reference: what a script that logs or branches on them reads.

Each query is called with no arguments after `initialize`; a dtype is recorded by name and a
config object as whether it is None. Left out: `zero_overlap_comm`, whose default in minispeed
differs from DeepSpeed's at stages 0-1 on purpose (Note [overlap_comm's default]), and
`get_batch_info`, which in DeepSpeed 0.19.8 returns its three bound methods, not their values. Recorded on
DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_engine_queries.py
```

which writes `tests/engine/fixtures/ds_engine_queries.json`;
`tests/engine/test_engine_ds_api_scripts.py` runs this file with its import line changed.
"""

import numbers
import sys
from pathlib import Path

import deepspeed
import torch

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_engine_queries.json"
QUERIES = [
    "steps_per_print", "optimizer_params", "scheduler_name",
    "scheduler_params", "get_data_types", "loss_scale", "dynamic_loss_scale",
    "initial_dynamic_scale", "dynamic_loss_scale_args", "flops_profiler_enabled",
    "zero_optimization_partition_gradients", "zero_optimization_partition_weights",
    "zero_offload_optimizer", "zero_offload_param", "zero_cpu_offload",
    "zero_nvme_offload_optimizer", "zero_use_cpu_optimizer", "zero_reduce_bucket_size",
    "zero_allgather_bucket_size", "zero_contiguous_gradients", "zero_reduce_scatter",
    "zero_ignore_unused_parameters", "zero_sub_group_size", "zero_prefetch_bucket_size",
    "zero_param_persistence_threshold", "zero_max_live_parameters", "zero_max_reuse_distance",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
]  # fmt: skip
CONFIGS = {
    "stage1_bf16_offload": {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "flops_profiler": {"enabled": False},
    },
    "stage3_offload_param": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "reduce_bucket_size": 1000,
            "stage3_max_live_parameters": 5000,
            "stage3_prefetch_bucket_size": 3000,
            "stage3_param_persistence_threshold": 10,
            "sub_group_size": 4096,
        },
        "fp16": {"enabled": False, "loss_scale": 128, "initial_scale_power": 8, "hysteresis": 3},
        "gradient_clipping": 0.5,
        "steps_per_print": 7,
        "zero_allow_untested_optimizer": True,
    },
    "stage0": {"train_micro_batch_size_per_gpu": 1},
}


def _value(v):
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, tuple):
        return [_value(x) for x in v]
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    if v is None or isinstance(v, bool | int | float | str | list | dict):
        return v
    return "<set>"  # a config object: recorded as present


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        optimizer = None if "optimizer" in config else torch.optim.Adam(model.parameters())
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        out[name] = {q: _value(getattr(engine, q)()) for q in QUERIES}
        engine.destroy()
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record  # refuses minispeed under DeepSpeed's name

    record(main(), FIXTURE)
