"""Every public name of DeepSpeed's engine, and what the ones a script may call answer, kept as a
reference: the names `DeepSpeedEngine` and `PipelineEngine` define, the config accessors'
answers for two configs, and what `set_train_batch_size` / `set_train_micro_batch_size`,
`module_state_dict` / `load_module_state_dict` and `get_wall_clock_timers` do.

Written against DeepSpeed's public API only. Per config, each accessor is called with no
arguments after `initialize` (a dtype recorded by name, an error by its type). Then a short run
of a small regressor at ZeRO 1 and 2 with SGD: two micro-steps at the configured batch,
`set_train_batch_size` to double the accumulation, four micro-steps, again to four accumulation
steps in the middle of the count (DeepSpeed ends the next window when the micro-step count is a
multiple of it), six micro-steps, then `set_train_micro_batch_size(3)` and one window; each
micro-step's loss, whether it ended a window, the batch triple after each change, the final
weights, and the error of a batch size that does not divide. Recorded on DeepSpeed 0.19.8, 2
gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_engine_names.py
```

which writes `tests/engine/fixtures/ds_engine_names.json`;
`tests/engine/test_engine_ds_names.py` walks the names on minispeed's engine and runs `main`
with the import line changed.
"""

import gc
import sys
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_engine_names.json"
ACCESSORS = [
    "autotp_size", "autotuning_enabled", "bf16_master_weights_and_gradients",
    "bf16_optimizer_states", "checkpoint_serialization_enabled",
    "checkpoint_tag_validation_enabled", "checkpoint_tag_validation_fail",
    "checkpoint_writer_enabled", "communication_data_type", "cpuadam_cores_perc",
    "curriculum_learning_enabled", "data_efficiency_enabled", "data_sampling_enabled",
    "dataloader_drop_last", "dump_state", "flops_profiler_detailed",
    "flops_profiler_module_depth", "flops_profiler_output_file", "flops_profiler_profile_step",
    "flops_profiler_recompute_fwd_factor", "flops_profiler_top_modules", "fp16_auto_cast",
    "fp16_master_weights_and_gradients", "get_data_parallel_rank", "get_model_parallel_rank",
    "get_tensor_parallel_rank", "get_type", "get_wall_clock_timers",
    "gradient_predivide_factor", "is_compiled", "is_first_weights_partition_group",
    "is_sanity_checks_enabled", "load_universal_checkpoint", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "optimizer_legacy_fusion",
    "optimizer_name", "postscale_gradients", "random_ltd_enabled", "super_offload",
    "torch_autocast_dtype", "torch_autocast_enabled", "use_node_local_storage",
    "zenflow_config", "zero_allgather_partitions", "zero_allgather_sequential",
    "zero_compute_grad_norm", "zero_elastic_checkpoint", "zero_hpz_partition_size",
    "zero_legacy_stage1", "zero_load_from_fp32_weights", "zero_log_trace_cache_warnings",
    "zero_model_persistence_threshold", "zero_module_granularity_threshold",
    "zero_multi_rank_bucket_allreduce", "zero_parameter_alignment", "zero_partial_offload",
    "zero_quantized_gradients", "zero_quantized_nontrainable_weights", "zero_quantized_weights",
    "zero_round_robin_gradients", "zero_save_muon_momentum_buffer_in_memory",
]  # fmt: skip
CONFIGS = {
    "stage1_bf16_by_name": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "checkpoint": {"tag_validation": "FAIL"},
        "flops_profiler": {
            "enabled": False,
            "module_depth": 2,
            "top_modules": 3,
            "detailed": False,
            "output_file": "profile.txt",
        },
        "dataloader_drop_last": False,
    },
    "stage3_torch_sgd": {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1},
        "checkpoint": {"tag_validation": "Ignore", "use_node_local_storage": True},
        "tensor_parallel": {"autotp_size": 1},
        "zero_allow_untested_optimizer": True,
    },
}
IN, OUT, LR = 6, 2, 0.05


def _value(v):
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, tuple | list):
        return [_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _value(x) for k, x in v.items()}
    return v


def _answer(engine, name):
    try:
        value = getattr(engine, name)
        return _value(value() if callable(value) else value)
    except Exception as e:  # DeepSpeed's own failures are recorded, by type
        return {"error": type(e).__name__}


def accessors():
    out = {}
    for name, config in CONFIGS.items():
        torch.manual_seed(0)
        model = nn.Linear(4, 4)
        optimizer = None
        if "optimizer" not in config:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optimizer, model_parameters=model.parameters(), config=config
        )
        out[name] = {q: _answer(engine, q) for q in ACCESSORS}
        engine.destroy()
    return out


def _batch(engine):
    return [
        engine.train_batch_size(),
        engine.train_micro_batch_size_per_gpu(),
        engine.gradient_accumulation_steps(),
    ]


def resized_run(stage, rank):
    """A regressor trained while its batch size changes (see the module docstring)."""
    torch.manual_seed(1)
    model = nn.Linear(IN, OUT)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    g = torch.Generator().manual_seed(100 + rank)
    record = {"losses": [], "boundaries": [], "batch": [_batch(engine)]}

    def micro_steps(n, rows):
        for _ in range(n):
            x, y = torch.randn(rows, IN, generator=g), torch.randn(rows, OUT, generator=g)
            record["boundaries"].append(engine.is_gradient_accumulation_boundary())
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            record["losses"].append(loss.item())

    micro_steps(2, 2)
    engine.set_train_batch_size(8)  # accumulation 1 -> 2 (2 ranks x micro-batch 2)
    record["batch"].append(_batch(engine))
    micro_steps(4, 2)
    engine.set_train_batch_size(16)  # -> 4, at micro-step 6: the next window ends at 8
    record["batch"].append(_batch(engine))
    micro_steps(6, 2)
    try:
        engine.set_train_batch_size(6)
        record["not_divisible"] = None
    except ValueError as e:
        record["not_divisible"] = str(e)
    record["batch"].append(_batch(engine))
    engine.set_train_micro_batch_size(3)
    record["batch"].append(_batch(engine))
    micro_steps(4, 3)
    record["global_steps"] = engine.global_steps
    record["weight"] = engine.module.weight.detach().flatten().tolist()
    engine.destroy()
    return record


def state_dicts():
    """`module_state_dict` (with and without the frozen bias), and `load_module_state_dict` of a
    changed state into a fresh engine (strict, then with a key missing and strict=False), which
    then steps from the loaded weights."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[1].bias.requires_grad_(False)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    state = engine.module_state_dict()
    out = {
        "keys": list(state),
        "without_frozen": list(engine.module_state_dict(exclude_frozen_parameters=True)),
        "prefixed": list(engine.module_state_dict(prefix="net.")),
    }
    torch.manual_seed(3)
    other = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    fresh, *_ = deepspeed.initialize(
        model=other, model_parameters=other.parameters(), config=config
    )
    doubled = {k: 2 * v for k, v in state.items()}
    fresh.load_module_state_dict({"module": doubled})
    out["loaded"] = [v.flatten().tolist() for v in fresh.module.state_dict().values()]
    partial = {k: -v for k, v in state.items() if k != "1.bias"}
    fresh.load_module_state_dict({"module": partial}, strict=False)
    out["partial"] = [v.flatten().tolist() for v in fresh.module.state_dict().values()]
    fresh.backward(fresh(torch.ones(2, 3)).pow(2).sum())  # a step from the loaded weights
    fresh.step()
    out["stepped"] = [v.flatten().tolist() for v in fresh.module.state_dict().values()]
    try:
        fresh.load_module_state_dict({"module": partial})
        out["strict_missing"] = None
    except RuntimeError as e:
        out["strict_missing"] = type(e).__name__
    engine.destroy()
    fresh.destroy()
    return out


def timers():
    """`get_wall_clock_timers()`'s names after one step, with and without wall_clock_breakdown."""
    out = {}
    for on in (False, True):
        model = nn.Linear(3, 1)
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "wall_clock_breakdown": on,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        }
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        engine.backward(engine(torch.ones(2, 3)).sum())
        engine.step()
        got = engine.get_wall_clock_timers()
        out[str(on)] = {
            "names": sorted(got),
            "non_negative": all(v >= 0 for v in got.values()),
        }
        engine.destroy()
    return out


def helpers():
    """The static dataset predicates and the garbage collection call."""
    data = torch.utils.data.TensorDataset(torch.zeros(4, 1))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    model = nn.Linear(2, 1)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    gc.collect()
    out = {
        "map_style": [engine.is_map_style_dataset(data), engine.is_map_style_dataset(Stream())],
        "iterable_style": [
            engine.is_iterable_style_dataset(data),
            engine.is_iterable_style_dataset(Stream()),
        ],
        "gc_is_int": isinstance(engine.collect_python_gc(), int),
    }
    engine.destroy()
    return out


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    return {
        "accessors": accessors(),
        "resized": {f"stage {s}": resized_run(s, rank) for s in (1, 2)},
        "state_dicts": state_dicts(),
        "timers": timers(),
        "helpers": helpers(),
    }


def public_names():
    """The names a script can reach on DeepSpeed's two engines (the classes' public names)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return {
        "engine": [n for n in dir(DeepSpeedEngine) if not n.startswith("_")],
        "pipe": [n for n in dir(PipelineEngine) if not n.startswith("_")],
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record  # refuses minispeed under DeepSpeed's name

    record({"names": public_names(), **main()}, FIXTURE)
