"""The whole ds_config: read once, checked everywhere, each section handed to its package.

```python
cfg = EngineConfig.load("ds_config.json", data_parallel_size=comm.get_world_size())
cfg.zero          # minispeed.zero.ZeroConfig (zero_optimization, with its offload sections)
cfg.precision     # minispeed.zero.MixedPrecision (cfg.fp16 / bf16 / data_types / torch_autocast)
cfg.train_batch_size, cfg.micro_batch_size, cfg.gradient_accumulation_steps
```

`EngineConfig` is the top level of the config pattern (docs/architecture.md, "The config
pattern"; `minispeed.core.sections`): each of its fields declares the top-level key it reads,
and each section is the typed dataclass of the package that owns it (`ZeroConfig`,
`PipelineConfig`, `FlopsProfilerConfig`, `CommsLoggerConfig`, ...), read by that class's
`from_section` at its key path. Past `EngineConfig` the engine reads typed fields only; `raw`
(the dict as given) is kept for `minispeed report --config`, which shows what was written.

What this module owns, and nothing more:

- **the batch triple** `train_batch_size = micro × accumulation × data-parallel size`, with
  DeepSpeed's derivation when one or two are given (`"auto"` counts as not given) and an error
  naming all three when they do not multiply out;
- **the top-level keys**: each is a field here (a value, or a package's section); a DeepSpeed
  key minispeed does not implement is refused by name unless it holds DeepSpeed's default;
  anything else is an unknown key with a did-you-mean;
- **what one section needs from another**: ZeRO gets the accumulation steps, the clipping norm
  and `aio`; the pipeline gets the batch and the stage count; `communication_data_type` must
  be the gradients' dtype.

Every check is local (no collective): each rank parses the same file and fails the same way
before the first collective, so a bad config never hangs a job. Every error starts with the key
path as written (`zero_optimization.offload_optimizer.buffer_count`), then the value and the fix.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from minispeed.comm import CommsLoggerConfig
from minispeed.compression import CompressionConfig
from minispeed.core.config import BATCH_KEYS, ConfigError, batch_triple, join_path
from minispeed.core.logging import warn_once
from minispeed.core.sections import (
    Section,
    Unsupported,
    build,
    ds_keys,
    ds_only,
    ds_refused,
    key,
    translate_section,
)
from minispeed.engine.by_name import OptimizerSection, SchedulerSection
from minispeed.engine.checkpoint.grid import CheckpointConfig
from minispeed.engine.elastic import ElasticConfig, adopt_batch
from minispeed.engine.legacy import LayerDropConfig, LegacyCurriculumConfig
from minispeed.engine.sequence_groups import sequence_size
from minispeed.offload import AioConfig
from minispeed.pipeline import PipelineConfig
from minispeed.profiler.config import FlopsProfilerConfig
from minispeed.profiler.monitor import (
    CometConfig,
    CsvMonitorConfig,
    MonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from minispeed.tensor_parallel import TensorParallelConfig
from minispeed.zero import (
    ActivationCheckpointingConfig,
    Bf16Config,
    DataTypesConfig,
    Fp16Config,
    MixedPrecision,
    TorchAutocastConfig,
    ZeroConfig,
)

__all__ = ["ConfigError", "EngineConfig", "load_ds_config", "resolve_batch"]


# Note [DeepSpeed clips at 1.0 by default]
# DeepSpeed 0.19.8 clips gradients to a global norm of 1.0 when `gradient_clipping` is left out
# (runtime/constants.py: GRADIENT_CLIPPING_DEFAULT = 1.0). A script that ports by changing its
# import must train the same thing, so the engine applies that default (EngineConfig's
# `gradient_clipping` field, which the reference page shows). (`ZeroConfig`, the package's own
# config, leaves clipping off unless the caller gives `max_grad_norm`.) Found when every
# DeepSpeed contender of benchmarks/zero_vs_torch.py ended 1.48 in loss away from DDP: the
# gradients it stepped were the same ones times min(1, 1/‖g‖).
DS_GRADIENT_CLIPPING_DEFAULT = 1.0

# Note [Megatron-DeepSpeed's legacy sections]
# Megatron-DeepSpeed's configs carry `curriculum_learning` (the engine passed
# `curriculum_seqlen=` to the forward), `progressive_layer_drop` (`progressive_layer_drop=` and
# `pld_theta=`) and `elasticity` (`compute_elastic_config` chose the batch for the world size).
# DeepSpeed 0.19.8 removed all three (deepspeed/runtime/config.py,
# `_REMOVED_TOP_LEVEL_CONFIG_KEYS`): it raises on the section at every value, `enabled: false`
# included, and has no `deepspeed.elasticity`, no `progressive_layer_drop` module, no
# `get_pld_theta` (tests/engine/fixtures/ds_curriculum.json). A job ported from it fails there
# as here; minispeed accepts the disabled section, which changes nothing. minispeed keeps
# `progressive_layer_drop` and the `seqlen` curriculum with DeepSpeed 0.17.6's meaning (the
# forward's keyword arguments: minispeed.engine.legacy) and `elasticity` (the batch triple
# chosen for the data-parallel size: minispeed.engine.elastic), recorded against 0.17.6 by
# scripts/record_ds_legacy.py. Only the
# curriculum's difficulty schedule survives in DeepSpeed, for its data-efficiency sampler:
# `minispeed.engine.curriculum`.

# DeepSpeed's top-level keys minispeed does not implement: accepted at DeepSpeed's default only
# (a config holding it loads unchanged), or refused at every value; each says what to use.
UNSUPPORTED: dict[str, Unsupported] = {
    "prescale_gradients": ds_only(
        False, "gradients are averaged once, after reduction (divide by N)"
    ),
    "gradient_predivide_factor": ds_only(
        1.0, "gradients are averaged once, after reduction (divide by N)"
    ),
    "sparse_gradients": ds_only(False, "embedding gradients are reduced dense"),
    "memory_breakdown": ds_only(
        False, "use minispeed.zero.measure(opt, model) for the bytes held per rank"
    ),
    "dump_state": ds_only(
        False, "print the resolved config with `python -m minispeed.engine.config report`"
    ),
    "amp": ds_only(
        {"enabled": False},
        "use bf16 or fp16 (minispeed.zero.MixedPrecision) instead of NVIDIA Apex AMP",
    ),
    # See Note [Megatron-DeepSpeed's legacy sections].
    "data_efficiency": ds_only({"enabled": False}, "no data-efficiency library"),
    "eigenvalue": ds_only({"enabled": False}, "no eigenvalue computation"),
    "hybrid_engine": ds_only({"enabled": False}, "no RLHF hybrid engine"),
    "autotuning": ds_only(
        {"enabled": False},
        "DeepSpeed's autotuning section is not read; run `minispeed tune` instead",
    ),
    "nebula": ds_only({"enabled": False}, "no Nebula checkpoint service"),
    "quantize_training": ds_only({"enabled": False}, "no quantization-aware training"),
    "sparse_attention": ds_refused(
        "sparse attention is an inference feature here (minispeed.inference)"
    ),
    "disable_allgather": ds_only(False, "stages 1-2 always all-gather the updated parameters"),
    "use_data_before_expert_parallelism": ds_only(
        False, "expert groups are built inside the data axis"
    ),
    "graph_harvesting": ds_only(False, "no CUDA graphs"),
    "mics_shard_size": ds_only(-1, "it belongs in zero_optimization (DeepSpeed's place for it)"),
    "mics_hierarchical_params_gather": ds_only(
        False, "it belongs in zero_optimization (DeepSpeed's place for it)"
    ),
    "load_universal_checkpoint": ds_only(
        False,
        "DeepSpeed 0.19.8 reads checkpoint.load_universal only (Megatron-DeepSpeed's "
        '--universal-checkpoint sets that); give "checkpoint": {"load_universal": true}. A '
        "universal folder loads without either key",
    ),
    "use_node_local_storage": ds_only(False, "give checkpoint.use_node_local_storage instead"),
    "seq_parallel_communication_data_type": ds_only(
        "fp32",
        "gradients reduce in data_types.grad_accum_dtype with or without sequence parallelism",
    ),
    "compile": ds_only(
        {"disable": False, "backend": "inductor", "kwargs": {}},
        "call torch.compile on the model yourself",
    ),
    "timers": ds_refused("wall_clock_breakdown turns the engine's timers on"),
    "weight_quantization": ds_refused("post-training int8 lives in minispeed.inference.quantize"),
    "moe": ds_refused("MoE is configured on the layer (minispeed.engine.moe.layer.MoE)"),
    "datastates_ckpt": ds_only(
        False, "DataStates-LLM's asynchronous checkpoint engine; use checkpoint.async_save"
    ),
    "data_parallel_size": ds_only(
        None, "the data-parallel size is the world over pipeline stages and tensor ranks"
    ),
    "dataloader_drop_last": ds_only(
        False, "no deepspeed_io data loader: build the DataLoader (drop_last) in the script"
    ),
    "disable_python_gc": ds_only(False, "the engine never drives Python's garbage collector"),
    "gradient_allreduce_op": ds_only(
        "mean", "gradients are averaged over the data-parallel ranks, DeepSpeed's default"
    ),
    "log_level": ds_only(
        None, "the engine logs through the minispeed logger; set its level with logging"
    ),
    "managed_gradient_accumulation": ds_only(
        True, "the engine always owns the accumulation boundary"
    ),
    "vocabulary_size": ds_only(None, "DeepSpeed reads it only for a tensor-core alignment warning"),
    "expert_parallel": ds_only(
        None,
        "DeepSpeed's AutoEP (experts found in a model by pattern); use the MoE layer "
        "(minispeed.engine.moe.layer.MoE)",
    ),
}


def load_ds_config(config: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """A ds_config as a dict: `config` is a dict already, or the path of a JSON file.

    A file that is not JSON is a `ConfigError` naming the file, line and column; a key given
    twice in one object (JSON's parsers keep the last silently) names the key's path and both
    values, as DeepSpeed refuses duplicate keys too.
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
        parsed = json.loads(text, object_pairs_hook=_json_object)
    except json.JSONDecodeError as e:
        raise ConfigError(
            "", f"{os.fspath(path)} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None
    if not isinstance(parsed, dict):
        raise ConfigError(
            "", f"{os.fspath(path)} must hold a JSON object, got {type(parsed).__name__}"
        )
    _refuse_duplicates(parsed, "", path)
    return parsed  # plain dicts: an object with a key given twice was refused


class _Duplicated(dict):
    """A JSON object that gives some key more than once, with every value of those keys."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: dict[str, list[Any]] = {}
        for name, value in pairs:
            seen.setdefault(name, []).append(value)
        self.duplicates = {k: v for k, v in seen.items() if len(v) > 1}


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A parsed JSON object: a plain dict, or a `_Duplicated` when a key repeats."""
    plain = dict(pairs)
    return plain if len(plain) == len(pairs) else _Duplicated(pairs)


def _refuse_duplicates(node: Any, where: str, path: Path) -> None:
    """The first key given twice in one object of the parsed file, by its path."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _refuse_duplicates(item, f"{where}[{i}]", path)
        return
    if not isinstance(node, dict):
        return
    for name, values in getattr(node, "duplicates", {}).items():
        shown = ", then ".join(json.dumps(v) for v in values)
        raise ConfigError(
            join_path(where, name),
            f"is given {len(values)} times in {os.fspath(path)} ({shown}); JSON would keep the "
            "last one silently: keep the one you mean",
        )
    for name, value in node.items():
        _refuse_duplicates(value, join_path(where, name), path)


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


def _clipping(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"must be a number (the largest global gradient norm; 0: off), got {value!r}"
        )
    if value < 0:
        raise ValueError(
            f"must be >= 0, got {value}: the largest global L2 norm of the gradients (0 turns "
            "clipping off)"
        )
    return float(value)


def _every(value: Any) -> int | None:
    """`steps_per_print`: a positive count; 0, a negative count, null or infinity (accelerate's
    "never", which DeepSpeed reads as a modulus): never."""
    if value is None or value == math.inf:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"must be an integer (optimizer steps between prints, or infinity: never), got "
            f"{value!r}"
        )
    return value if value > 0 else None


_BATCH = {"anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}]}
_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class EngineConfig(Section):
    """The resolved ds_config: the batch triple, each package's typed section, the engine's own
    settings. Built by `EngineConfig.from_ds_config`; `raw` keeps the dict as given."""

    ds_unsupported: ClassVar[dict[str, Unsupported]] = UNSUPPORTED

    train_batch_size: int = key("train_batch_size", schema=_BATCH)
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch_size: int = key("train_micro_batch_size_per_gpu", schema=_BATCH)
    """Samples per rank per forward."""
    gradient_accumulation_steps: int = key("gradient_accumulation_steps", schema=_BATCH)
    """Micro-batches per optimizer step."""
    data_parallel_size: int
    """Ranks that split each batch (the world size over pipeline stages and tensor ranks)."""
    zero: ZeroConfig = key("zero_optimization", section=ZeroConfig)
    """ZeRO: which stage, its buckets, offload and ZeRO++ (minispeed.zero)."""
    precision: MixedPrecision
    """The dtypes, from `fp16` / `bf16` / `data_types` (`MixedPrecision.from_sections`)."""
    fp16: Fp16Config = key("fp16", default_factory=Fp16Config, section=Fp16Config)
    """fp16 mixed precision with a dynamic loss scale (minispeed.zero.MixedPrecision)."""
    bf16: Bf16Config = key(
        "bf16", default_factory=Bf16Config, aliases=("bfloat16",), section=Bf16Config
    )
    """bf16 mixed precision (minispeed.zero.MixedPrecision)."""
    data_types: DataTypesConfig = key(
        "data_types", default_factory=DataTypesConfig, section=DataTypesConfig
    )
    """Data types: the gradients' accumulation and reduction dtype."""
    torch_autocast: TorchAutocastConfig = key(
        "torch_autocast", default_factory=TorchAutocastConfig, section=TorchAutocastConfig
    )
    """fp32 parameters, the forward under torch.autocast (minispeed.zero.Autocast)."""
    # See Note [DeepSpeed clips at 1.0 by default].
    gradient_clipping: float = key(
        "gradient_clipping", DS_GRADIENT_CLIPPING_DEFAULT, read=_clipping
    )
    """Clip the gradients to this global L2 norm before each step (DeepSpeed's default, 1.0,
    when left out); 0: off. Handed to ZeRO as `ZeroConfig.max_grad_norm`."""
    optimizer: OptimizerSection | None = key("optimizer", None, section=OptimizerSection)
    """The optimizer by name (`{"type", "params"}`), built by `engine.optim`."""
    scheduler: SchedulerSection | None = key("scheduler", None, section=SchedulerSection)
    """The learning-rate schedule by name, built by `engine.lr_schedules`."""
    steps_per_print: int | None = key("steps_per_print", None, read=_every)
    """Print loss, learning rate and step time on rank 0 every this many optimizer steps
    (null, 0 or less: never)."""
    wall_clock_breakdown: bool = key("wall_clock_breakdown", False)
    """Time forward, backward and step (the engine's timers) and print them with the loss."""
    comms_logger: CommsLoggerConfig = key(
        "comms_logger", default_factory=CommsLoggerConfig, section=CommsLoggerConfig
    )
    """The comms logger (minispeed.comm)."""
    flops_profiler: FlopsProfilerConfig = key(
        "flops_profiler", default_factory=FlopsProfilerConfig, section=FlopsProfilerConfig
    )
    """The FLOPs profiler (minispeed.profiler)."""
    tensorboard: TensorBoardConfig = key(
        "tensorboard", default_factory=TensorBoardConfig, section=TensorBoardConfig
    )
    """TensorBoard events of the learning rate, loss scale, losses and timers, on rank 0
    (minispeed.profiler.monitor)."""
    wandb: WandbConfig = key("wandb", default_factory=WandbConfig, section=WandbConfig)
    """The same events to Weights & Biases, on rank 0 (minispeed.profiler.monitor)."""
    csv_monitor: CsvMonitorConfig = key(
        "csv_monitor", default_factory=CsvMonitorConfig, section=CsvMonitorConfig
    )
    """The same events appended to one CSV file per name, on rank 0
    (minispeed.profiler.monitor)."""
    comet: CometConfig = key("comet", default_factory=CometConfig, section=CometConfig)
    """The same events to a Comet experiment, on rank 0 (minispeed.profiler.monitor)."""
    activation_checkpointing: ActivationCheckpointingConfig | None = key(
        "activation_checkpointing", None, section=ActivationCheckpointingConfig
    )
    """Activation checkpointing for model code that calls `deepspeed.checkpointing.checkpoint`
    (minispeed.zero.checkpoint); None when the section is left out (then `initialize` leaves
    `deepspeed.checkpointing.configure`'s settings as they are)."""
    pipeline: PipelineConfig | None = key("pipeline", None, section=PipelineConfig)
    """Pipeline parallelism (minispeed.pipeline): given, or the PipelineModule's; None when
    neither."""
    checkpoint: CheckpointConfig = key(
        "checkpoint", default_factory=CheckpointConfig, section=CheckpointConfig
    )
    """Checkpoints (minispeed.engine.checkpoint)."""
    tensor_parallel: TensorParallelConfig = key(
        "tensor_parallel", default_factory=TensorParallelConfig, section=TensorParallelConfig
    )
    """Tensor parallelism (minispeed.tensor_parallel) on the engine's pipe x data x tensor grid:
    ZeRO over the data axis, clipping over all three (docs: 3D parallelism)."""
    sequence_parallel_size: int | None = key(
        "sequence_parallel_size",
        None,
        read=sequence_size,
        schema={"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
    )
    """DeepSpeed-Ulysses: ranks that split each sequence (S); the grid is data x sequence and
    the batch counts D = world / S replicas. ZeRO shards over all D x S ranks, summing the
    sequence ranks' gradients (stages 0-2) or averaging them (stage 3's reduce-scatter), as
    DeepSpeed (`minispeed.engine.sequence_groups`). The model's attention runs in
    `DistributedAttention` (minispeed.tensor_parallel.ulysses). null or 1: off."""
    compression: CompressionConfig = key(
        "compression_training",
        default_factory=CompressionConfig,
        read=CompressionConfig.from_ds_config,
        schema={"type": "object"},
    )
    """Quantization-aware training, pruning and layer reduction (minispeed.compression): the
    model is compressed by `init_compression(model, ds_config)` before `initialize`; the
    engine switches each technique on at its `schedule_offset` (`compression.Schedule`)."""
    layer_drop: LayerDropConfig = key(
        "progressive_layer_drop",
        default_factory=LayerDropConfig,
        read=LayerDropConfig.from_ds_config,
        schema={"type": "object"},
    )
    """Progressive layer drop, DeepSpeed 0.17.6's (0.19.8 removed it): every training forward
    gets `progressive_layer_drop=True, pld_theta=theta(t)`, `theta(t) = (1 - theta)
    e^(-gamma (t - 1)) + theta` after `t >= 1` steps, 1 before; `engine.get_pld_theta()`
    (minispeed.engine.legacy)."""
    legacy_curriculum: LegacyCurriculumConfig = key(
        "curriculum_learning",
        default_factory=LegacyCurriculumConfig,
        read=LegacyCurriculumConfig.from_ds_config,
        schema={"type": "object"},
    )
    """The legacy sequence-length curriculum, DeepSpeed 0.17.6's (0.19.8 removed it):
    `curriculum_type: "seqlen"` only; every training forward gets `curriculum_seqlen=` the
    schedule's running difficulty (minispeed.engine.curriculum's schedules); not with a
    pipeline (minispeed.engine.legacy)."""
    elasticity: ElasticConfig = key(
        "elasticity",
        default_factory=ElasticConfig,
        read=ElasticConfig.from_ds_config,
        schema={"type": "object"},
    )
    """Elastic batch sizes, DeepSpeed 0.17.6's (0.19.8 removed them): enabled, the batch
    triple is chosen for the data-parallel size from `max_train_batch_size` and
    `micro_batch_sizes` (one global batch valid for every world size in `min_gpus`..`max_gpus`);
    a world size outside it is refused naming those keys (minispeed.engine.elastic)."""
    aio: AioConfig = key("aio", default_factory=AioConfig, section=AioConfig)
    """Asynchronous I/O for NVMe offload (minispeed.offload)."""
    communication_data_type: str | None = key(
        "communication_data_type", None, schema={"enum": ["fp32", "fp16", "bf16", None]}
    )
    """Accepted when equal to `data_types.grad_accum_dtype`: gradients travel in it here."""
    zero_allow_untested_optimizer: bool = key("zero_allow_untested_optimizer", False)
    """Accept an optimizer not known to be elementwise at ZeRO stages 1-3 (refused otherwise)."""
    zero_force_ds_cpu_optimizer: bool = key("zero_force_ds_cpu_optimizer", True)
    """With `zero_optimization.offload_optimizer` on, refuse an optimizer passed to
    `initialize` unless it is offload's `CPUAdam` (DeepSpeed's `DeepSpeedCPUAdam`) or
    `CPULion`, as DeepSpeed does; false: offload steps a torch Adam, AdamW or Adagrad with its
    CPU kernel, with that optimizer's settings."""
    raw: dict[str, Any] = field(default_factory=dict)
    """The ds_config as given (read by `minispeed report --config`, and by `get`)."""

    def get(self, key: str, default: Any = None) -> Any:
        """The top-level ds_config entry `key` as given: DeepSpeed's `engine.config` is that
        dict, and clients read it (`engine.config.get("zero_optimization", {})`); the engine
        itself reads the typed fields."""
        return self.raw.get(key, default)

    @property
    def monitor(self) -> MonitorConfig:
        """The four monitor sections together (DeepSpeed's `monitor_config`)."""
        return MonitorConfig(self.tensorboard, self.wandb, self.csv_monitor, self.comet)

    @property
    def tensor_parallel_size(self) -> int:
        """T, the grid's tensor axis (`tensor_parallel.autotp_size`; 0 or absent: 1)."""
        return self.tensor_parallel.size

    @classmethod
    def load(
        cls,
        config: str | os.PathLike | Mapping[str, Any],
        *,
        data_parallel_size: int = 1,
        pipeline_stages: int | None = None,
    ) -> EngineConfig:
        """`from_ds_config(load_ds_config(config), ...)`: a path or a dict."""
        return cls.from_ds_config(
            load_ds_config(config),
            data_parallel_size=data_parallel_size,
            pipeline_stages=pipeline_stages,
        )

    @classmethod
    def from_ds_config(
        cls,
        ds: Mapping[str, Any],
        *,
        data_parallel_size: int = 1,
        pipeline_stages: int | None = None,
    ) -> EngineConfig:
        """Check every key of `ds` and resolve it (see the module docstring).
        `pipeline_stages`: the PipelineModule's stage count, for a pipeline model (the
        `pipeline` section is then read with it, `"auto"` meaning it)."""
        ds = _without_dotted_paths(ds)
        # Each package reads its own section (`from_section`); the two that need values from
        # elsewhere in the ds_config are read below, with them.
        with_context = (*BATCH_KEYS, "zero_optimization", "pipeline")
        kwargs = translate_section(cls, {k: v for k, v in ds.items() if k not in with_context}, "")
        elastic = kwargs.get("elasticity")
        if elastic is not None and elastic.enabled:  # the batch from the world size
            ds = adopt_batch(ds, elastic, data_parallel_size)
        train, micro, gas = resolve_batch(ds, data_parallel_size)
        aio = kwargs.setdefault("aio", AioConfig())
        kwargs["zero"] = ZeroConfig.from_section(
            ds.get("zero_optimization"),
            gradient_accumulation_steps=gas,
            # See Note [DeepSpeed clips at 1.0 by default].
            max_grad_norm=kwargs.get("gradient_clipping", DS_GRADIENT_CLIPPING_DEFAULT),
            aio=aio,
        )
        kwargs["precision"] = MixedPrecision.from_sections(
            kwargs.get("fp16"),
            kwargs.get("bf16"),
            kwargs.get("data_types"),
            kwargs.get("torch_autocast"),
        )
        _check_communication_dtype(kwargs.get("communication_data_type"), kwargs["precision"])
        if kwargs["precision"].autocast is not None and kwargs["zero"].quantized_weights:
            raise ConfigError(
                "torch_autocast.enabled",
                "true, and so is zero_optimization.zero_quantized_weights (as in DeepSpeed, "
                "the two do not combine): turn one of them off",
            )
        if ds.get("pipeline") is not None or pipeline_stages is not None:
            if kwargs["precision"].autocast is not None and kwargs["zero"].stage >= 2:
                raise ConfigError(
                    "torch_autocast.enabled",
                    f"true with a pipeline at zero_optimization.stage {kwargs['zero'].stage}: "
                    "minispeed runs a pipeline under torch.autocast at ZeRO stage 0 or 1 only "
                    "(DeepSpeed's pipelines take no other); set the stage to 0 or 1, or "
                    "torch_autocast.enabled to false",
                )
            if (
                kwargs["precision"].autocast is not None
                and kwargs["precision"].autocast.scales_loss
            ):
                raise ConfigError(
                    "torch_autocast.dtype",
                    "float16 with a pipeline: minispeed runs a pipeline under bf16 autocast only "
                    "(fp16's loss scale across the stages is not checked against DeepSpeed's); "
                    "set torch_autocast.dtype to bfloat16",
                )
            kwargs["pipeline"] = PipelineConfig.from_section(
                ds.get("pipeline"),
                micro_batch_size=micro,
                gradient_accumulation_steps=gas,
                data_parallel_size=data_parallel_size,
                known_stages=pipeline_stages,
            )
        kwargs.update(
            train_batch_size=train,
            micro_batch_size=micro,
            gradient_accumulation_steps=gas,
            data_parallel_size=data_parallel_size,
            raw=ds,
        )
        return build(cls, "", kwargs, ds)


# Note [a dotted path at the top level]
# TRL writes the sizes it wants for its reference model as dotted top-level keys
# (`config["zero_optimization.reduce_bucket_size"] = h * h`), accelerate's spelling for filling
# in a nested key. DeepSpeed 0.19.8 reads nested sections only and ignores unknown top-level
# keys, so those keys change nothing there and the run goes on. Refusing them as unknown keys
# would stop every TRL run; reading them would train differently from DeepSpeed. A top-level key
# that is a dotted path into a section we read is therefore left out, with a warning naming the
# nested form that would set it; any other unknown key is still refused with a did-you-mean.


def _without_dotted_paths(ds: Mapping[str, Any]) -> dict[str, Any]:
    """`ds` without its top-level keys that are dotted paths into a known section (Note [a
    dotted path at the top level]), each reported once."""
    kept = {}
    for name, value in ds.items():
        head, dot, rest = name.partition(".")
        if dot and rest and head in READ:
            parts = [head, *rest.split(".")]
            nested = "".join(f'{{"{p}": ' for p in parts) + "..." + "}" * len(parts)
            warn_once(
                f"ds_config key {name!r} is a dotted path at the top level, which DeepSpeed does "
                f"not read either: it is ignored. To set it, write it nested: {nested}"
            )
            continue
        kept[name] = value
    return kept


def top_level_keys() -> frozenset[str]:
    """Every top-level key `EngineConfig` reads (aliases included)."""
    names = set()
    for name, (_, k) in ds_keys(EngineConfig).items():
        names |= {name, *k.aliases}
    return frozenset(names)


# The top-level keys the engine (or a package it hands them to) reads: EngineConfig's fields.
READ = top_level_keys()


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
