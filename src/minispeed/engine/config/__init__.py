"""The whole ds_config: read once, checked everywhere, each section handed to its package.

```python
cfg = EngineConfig.load("ds_config.json", data_parallel_size=comm.get_world_size())
cfg.zero          # minispeed.zero.ZeroConfig (zero_optimization, gradient_clipping, accumulation)
cfg.precision     # minispeed.zero.MixedPrecision (fp16 / bf16 / data_types)
cfg.train_batch_size, cfg.micro_batch_size, cfg.gradient_accumulation_steps
```

What this module owns, and nothing more:

- **the batch triple** `train_batch_size = micro × accumulation × data-parallel size`, with
  DeepSpeed's derivation when one or two are given (`"auto"` counts as not given) and an error
  naming all three when they do not multiply out;
- **the top-level keys**: each is read here or by a package (`zero_optimization` by
  `ZeroConfig.from_ds_config`, `fp16`/`bf16` by `MixedPrecision.from_ds_config`, `flops_profiler`
  by the profiler, `pipeline` by the pipeline package, `optimizer`/`scheduler` by
  `engine.optim`/`engine.lr_schedules`); a DeepSpeed key minispeed does not implement is refused by
  name unless it holds DeepSpeed's default; anything else is an unknown key with a did-you-mean.

Every check is local (no collective): each rank parses the same file and fails the same way
before the first collective, so a bad config never hangs a job.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minispeed.core.config import (
    BATCH_KEYS,
    DEEPSPEED_TOP_LEVEL,
    ConfigError,
    batch_triple,
    check_keys,
    join_path,
)
from minispeed.engine.checkpoint.grid import CheckpointConfig
from minispeed.engine.grid import tensor_parallel_size
from minispeed.zero import MixedPrecision, ZeroConfig

__all__ = ["ConfigError", "EngineConfig", "load_ds_config", "resolve_batch"]


# Note [DeepSpeed clips at 1.0 by default]
# DeepSpeed 0.19.8 clips gradients to a global norm of 1.0 when `gradient_clipping` is left out
# (runtime/constants.py: GRADIENT_CLIPPING_DEFAULT = 1.0). A script that ports by changing its
# import must train the same thing, so the engine applies that default. (`ZeroConfig.from_ds_config`,
# the package's own translation, leaves clipping off unless the key is given.) Found when every
# DeepSpeed contender of benchmarks/zero_vs_torch.py ended 1.48 in loss away from DDP: the
# gradients it stepped were the same ones times min(1, 1/‖g‖).
DS_GRADIENT_CLIPPING_DEFAULT = 1.0

# DeepSpeed keys minispeed does not implement, each with the reason; accepted at the default below.
UNSUPPORTED = {
    "prescale_gradients": "gradients are averaged once, after reduction (divide by N)",
    "gradient_predivide_factor": "gradients are averaged once, after reduction (divide by N)",
    "sparse_gradients": "embedding gradients are reduced dense",
    "memory_breakdown": "use minispeed.zero.measure(opt, model) for the bytes held per rank",
    "dump_state": "print the resolved config with `python -m minispeed.engine.config report`",
    "amp": "use bf16 or fp16 (minispeed.zero.MixedPrecision) instead of NVIDIA Apex AMP",
    "torch_autocast": "use bf16 or fp16 (minispeed.zero.MixedPrecision)",
    "tensorboard": "no monitor backends; read the engine's per-step losses and timers",
    "wandb": "no monitor backends; read the engine's per-step losses and timers",
    "csv_monitor": "no monitor backends; read the engine's per-step losses and timers",
    "comet": "no monitor backends; read the engine's per-step losses and timers",
    "elasticity": "no elastic batch sizes; torchrun restarts whole jobs",
    "curriculum_learning": "no curriculum learning",
    "data_efficiency": "no data-efficiency library",
    "compression_training": "no compression training",
    "eigenvalue": "no eigenvalue computation",
    "progressive_layer_drop": "no progressive layer drop",
    "hybrid_engine": "no RLHF hybrid engine",
    "autotuning": "DeepSpeed's autotuning section is not read; run `minispeed tune` instead",
    "nebula": "no Nebula checkpoint service",
    "quantize_training": "no quantization-aware training",
    "sparse_attention": "sparse attention is an inference feature here (minispeed.inference)",
    "disable_allgather": "stages 1-2 always all-gather the updated parameters",
    "use_data_before_expert_parallelism": "expert groups are built inside the data axis",
    "graph_harvesting": "no CUDA graphs",
    "mics_shard_size": "no MiCS sharding; use ZeRO-3 (optionally with hpZ)",
    "mics_hierarchical_params_gather": "no MiCS sharding; use ZeRO-3 (optionally with hpZ)",
    "load_universal_checkpoint": "checkpoints load at any data-parallel size already",
    "use_node_local_storage": "give checkpoint.use_node_local_storage instead",
    "seq_parallel_communication_data_type": "no sequence parallelism in training",
    "compile": "call torch.compile on the model yourself",
    "timers": "wall_clock_breakdown turns the engine's timers on",
    "weight_quantization": "post-training int8 lives in minispeed.inference.quantize",
    "moe": "MoE is configured on the layer (minispeed.engine.moe.layer.MoE)",
}
# The top-level keys the engine (or a package it hands them to) reads: every DeepSpeed key
# (core's list, shared with the packages' spelling checks) but the unsupported ones above.
READ = DEEPSPEED_TOP_LEVEL - UNSUPPORTED.keys()
# DeepSpeed's default for each unsupported key: a config holding these loads unchanged.
DEFAULTS: dict[str, Any] = {
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "sparse_gradients": False,
    "memory_breakdown": False,
    "dump_state": False,
    "amp": {"enabled": False},
    "torch_autocast": {"enabled": False},
    "tensorboard": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "wandb": {"enabled": False, "group": None, "team": None, "project": "deepspeed"},
    "csv_monitor": {"enabled": False, "output_path": "", "job_name": "DeepSpeedJobName"},
    "comet": {"enabled": False},
    "elasticity": {"enabled": False},
    "curriculum_learning": {"enabled": False},
    "data_efficiency": {"enabled": False},
    "eigenvalue": {"enabled": False},
    "progressive_layer_drop": {"enabled": False},
    "hybrid_engine": {"enabled": False},
    "autotuning": {"enabled": False},
    "nebula": {"enabled": False},
    "quantize_training": {"enabled": False},
    "disable_allgather": False,
    "use_data_before_expert_parallelism": False,
    "graph_harvesting": False,
    "mics_shard_size": -1,
    "mics_hierarchical_params_gather": False,
    "load_universal_checkpoint": False,
    "use_node_local_storage": False,
    "seq_parallel_communication_data_type": "fp32",
    "compile": {"disable": False, "backend": "inductor", "kwargs": {}},
}

_COMMS_LOGGER = {"enabled", "verbose", "prof_all", "prof_ops", "debug"}
_ACTIVATION = {"cpu_checkpointing", "number_checkpoints", "synchronize_checkpoint_boundary"}
_ACTIVATION_UNSUPPORTED = {
    "partition_activations": "checkpointed activations are not split over tensor-parallel ranks",
    "contiguous_memory_optimization": "checkpointed activations are ordinary tensors",
    "profile": "time checkpointed regions with minispeed.profiler",
}
_ACTIVATION_DEFAULTS = {
    "partition_activations": False,
    "contiguous_memory_optimization": False,
    "profile": False,
}


def load_ds_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A ds_config as a dict: `config` is a dict already, or the path of a JSON file.

    A file that is not JSON is a `ConfigError` naming the file, line and column.
    """
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, str | os.PathLike):
        raise ConfigError(
            "",
            f"config must be a dict or the path of a ds_config.json, got {type(config).__name__}",
        )
    path = Path(config)
    if not path.is_file():
        raise ConfigError("", f"config file {os.fspath(path)!r} does not exist")
    text = path.read_text()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            "", f"{os.fspath(path)} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None
    if not isinstance(parsed, dict):
        raise ConfigError(
            "", f"{os.fspath(path)} must hold a JSON object, got {type(parsed).__name__}"
        )
    return parsed


def _batch_value(ds: Mapping[str, Any], key: str) -> int | None:
    value = ds.get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, f'must be a positive integer or "auto", got {value!r}')
    return value


def resolve_batch(ds: Mapping[str, Any], data_parallel_size: int) -> tuple[int, int, int]:
    """`(train_batch_size, micro_batch_size, gradient_accumulation_steps)` from a ds_config by
    DeepSpeed's rule (`minispeed.core.config.batch_triple`); `"auto"` counts as not given."""
    values = [_batch_value(ds, key) for key in BATCH_KEYS]
    if values[0] is None and values[1] is None and "auto" in (ds.get(k) for k in BATCH_KEYS[:2]):
        raise ConfigError(
            "train_batch_size",
            '"auto" batch sizes are filled in by Hugging Face\'s Trainer, not by initialize(): '
            "give train_batch_size or train_micro_batch_size_per_gpu a number",
        )
    return batch_triple(*values, data_parallel_size)


def _check_type_section(ds: Mapping[str, Any], key: str) -> None:
    section = ds.get(key)
    if section is None:
        return
    check_keys(section, {"type", "params"}, key)
    if not isinstance(section.get("type"), str):
        raise ConfigError(join_path(key, "type"), f'give the {key} type by name, e.g. "AdamW"')
    if not isinstance(section.get("params", {}), Mapping):
        raise ConfigError(join_path(key, "params"), "must be a JSON object of keyword arguments")


@dataclass(frozen=True)
class EngineConfig:
    """The resolved ds_config: the batch triple, each package's typed section, the engine's own
    settings. Built by `EngineConfig.from_ds_config`; `raw` keeps the dict as given."""

    train_batch_size: int
    """Samples per optimizer step over all data-parallel ranks (`train_batch_size`)."""
    micro_batch_size: int
    """Samples per rank per forward (`train_micro_batch_size_per_gpu`)."""
    gradient_accumulation_steps: int
    """Micro-batches per optimizer step (`gradient_accumulation_steps`)."""
    data_parallel_size: int
    """Ranks that split each batch (the world size over pipeline stages)."""
    zero: ZeroConfig
    """`zero_optimization`, `gradient_clipping`, the accumulation steps and offload sections."""
    precision: MixedPrecision
    """`fp16` / `bf16` / `data_types`."""
    optimizer: dict[str, Any] | None = None
    """The `optimizer` section (`{"type", "params"}`), built by `engine.optim`."""
    scheduler: dict[str, Any] | None = None
    """The `scheduler` section, built by `engine.lr_schedules`."""
    steps_per_print: int | None = None
    """Print loss, learning rate and step time on rank 0 every this many optimizer steps."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step (the engine's timers) and print them with the loss."""
    comms_logger: dict[str, Any] = field(default_factory=dict)
    """`comms_logger`: `enabled` records every collective into `engine.comms_logger`."""
    flops_profiler: Any = None
    """`minispeed.profiler.FlopsProfilerConfig` when the section is present."""
    activation_checkpointing: dict[str, Any] = field(default_factory=dict)
    """`activation_checkpointing` (`cpu_checkpointing`, `number_checkpoints`, ...)."""
    pipeline: dict[str, Any] = field(default_factory=dict)
    """The `pipeline` section, read by the pipeline engine."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """The `checkpoint` section (`async_save`, `use_node_local_storage`)."""
    tensor_parallel_size: int = 1
    """`tensor_parallel.autotp_size`: ranks that split each layer (the grid's tensor axis, T;
    0 or absent: 1). The data-parallel size is then world / (pipeline stages · T)."""
    raw: dict[str, Any] = field(default_factory=dict)
    """The ds_config as given."""

    def get(self, key: str, default: Any = None) -> Any:
        """The top-level ds_config entry `key` as given: DeepSpeed's `engine.config` is that
        dict, and clients read it (`engine.config.get("zero_optimization", {})`)."""
        return self.raw.get(key, default)

    @classmethod
    def load(
        cls, config: str | os.PathLike | Mapping[str, Any], *, data_parallel_size: int = 1
    ) -> EngineConfig:
        """`from_ds_config(load_ds_config(config), ...)`: a path or a dict."""
        return cls.from_ds_config(load_ds_config(config), data_parallel_size=data_parallel_size)

    @classmethod
    def from_ds_config(cls, ds: Mapping[str, Any], *, data_parallel_size: int = 1) -> EngineConfig:
        """Check every key of `ds` and resolve it (see the module docstring)."""
        ds = dict(ds)
        check_keys(ds, READ, "", unsupported=UNSUPPORTED, defaults=DEFAULTS)
        train, micro, gas = resolve_batch(ds, data_parallel_size)
        for key in ("optimizer", "scheduler"):
            _check_type_section(ds, key)
        check_keys(ds.get("comms_logger") or {}, _COMMS_LOGGER, "comms_logger")
        check_keys(
            ds.get("activation_checkpointing") or {},
            _ACTIVATION,
            "activation_checkpointing",
            unsupported=_ACTIVATION_UNSUPPORTED,
            defaults=_ACTIVATION_DEFAULTS,
        )
        checkpoint = _package("checkpoint", CheckpointConfig.from_ds_config, ds.get("checkpoint"))
        tensor = tensor_parallel_size(ds)  # the grid's tensor axis (engine/grid.py)
        # Each package reads its own section; the few values it needs from elsewhere in the
        # ds_config are handed over by name. Their ValueErrors are re-raised with the key path.
        zero = _package(
            "zero_optimization",
            lambda section: ZeroConfig.from_section(
                section,
                gradient_accumulation_steps=gas,
                # See Note [DeepSpeed clips at 1.0 by default].
                gradient_clipping=ds.get("gradient_clipping", DS_GRADIENT_CLIPPING_DEFAULT),
                aio=ds.get("aio"),
            ),
            ds.get("zero_optimization"),
        )
        # MixedPrecision owns the fp16/bf16/data_types sections and bf16's old name `bfloat16`.
        precision = _package(
            "fp16/bf16",
            MixedPrecision.from_ds_config,
            {k: v for k, v in ds.items() if k in ("fp16", "bf16", "bfloat16", "data_types")},
        )
        _check_communication_dtype(ds.get("communication_data_type"), precision)
        profiler = None
        if ds.get("flops_profiler") is not None:
            from minispeed.profiler.config import FlopsProfilerConfig

            profiler = _package(
                "flops_profiler", FlopsProfilerConfig.from_ds_config, ds["flops_profiler"]
            )
        if ds.get("pipeline") is not None:  # its keys; the pipeline engine reads the values
            from minispeed.pipeline import PipelineConfig

            _package(
                "pipeline",
                lambda section: PipelineConfig.from_section(
                    section,
                    micro_batch_size=micro,
                    gradient_accumulation_steps=gas,
                    data_parallel_size=data_parallel_size,
                ),
                ds["pipeline"],
            )
        steps_per_print = ds.get("steps_per_print")
        if steps_per_print == math.inf:  # accelerate's "never" (DeepSpeed reads it as a modulus)
            steps_per_print = None
        if steps_per_print is not None and (
            isinstance(steps_per_print, bool) or not isinstance(steps_per_print, int)
        ):
            raise ConfigError(
                "steps_per_print",
                f"must be an integer (or infinity: never), got {steps_per_print!r}",
            )
        return cls(
            train_batch_size=train,
            micro_batch_size=micro,
            gradient_accumulation_steps=gas,
            data_parallel_size=data_parallel_size,
            zero=zero,
            precision=precision,
            optimizer=ds.get("optimizer"),
            scheduler=ds.get("scheduler"),
            steps_per_print=steps_per_print if steps_per_print and steps_per_print > 0 else None,
            wall_clock_breakdown=bool(ds.get("wall_clock_breakdown", False)),
            comms_logger=dict(ds.get("comms_logger") or {}),
            flops_profiler=profiler,
            activation_checkpointing=dict(ds.get("activation_checkpointing") or {}),
            pipeline=dict(ds.get("pipeline") or {}),
            checkpoint=checkpoint,
            tensor_parallel_size=tensor,
            raw=ds,
        )


def _package(path: str, build: Any, section: Any) -> Any:
    """Run a package's `from_ds_config`, turning its ValueError/TypeError into a ConfigError
    that keeps the package's message (which names the key) and adds the section."""
    try:
        return build(section)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(path, str(e)) from e


_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _check_communication_dtype(value: Any, precision: MixedPrecision) -> None:
    """`communication_data_type`: gradients travel in `data_types.grad_accum_dtype` here."""
    if value is None:
        return
    travel = str(precision.grad_accum_dtype).removeprefix("torch.")
    if _DTYPE_NAMES.get(str(value).lower()) != travel:
        raise ConfigError(
            "communication_data_type",
            f"minispeed reduces gradients in the accumulation dtype ({travel}), not {value!r}; "
            f"set data_types.grad_accum_dtype to choose it, and remove communication_data_type",
        )
