"""minispeed.engine: DeepSpeed's API over minispeed's packages, so a DeepSpeed script runs with
its import line changed (`import minispeed.engine as deepspeed`).

```python
import minispeed.engine as deepspeed
engine, optimizer, loader, scheduler = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config="ds_config.json")
print(engine.describe())      # what initialize did to the model, step by step
```

`initialize` composes the packages in one fixed order (each step selected by the config; the
functions are `steps.py`'s, each recording what it did for `engine.describe()`):

1. read and check the whole config on every rank (no collective yet): `EngineConfig` (under
   `minispeed tune`, `MINISPEED_TRIAL`'s config replaces the script's and the engine ends the
   job after the trial's steps: `tune/trial.py`, handed to the engine as a step observer);
2. `init_distributed` (torchrun's environment, or a single process); the grid's shape (pipe ×
   data × tensor, `grid.py`), checked before any collective, then its groups (a
   `minispeed.pipeline.PipelineModule` brings its own);
3. with `tensor_parallel.autotp_size` > 1 the tensor-parallel plan applied to the model (or to
   each pipeline stage), agreed by every rank (`minispeed.tensor_parallel.parallelize_everywhere`);
4. the `activation_checkpointing` section configures `minispeed.engine.checkpointing`
   (DeepSpeed's `deepspeed.checkpointing`) for model code that calls its `checkpoint`;
5. the optimizer: the one given, a callable of the parameters, or the config's by name;
6. `zero.shard` over the data-parallel group (stage, precision, offload, ZeRO++; MiCS over the
   grid's shard and replica groups), the experts of
   `minispeed.moe.MoE` layers over their expert-data group (`experts.py`), the grid's other
   axes as ZeRO's model-parallel axes;
7. the scheduler: the one given, a callable of the optimizer, or the config's by name;
8. the engine (`Engine`), with the profiler, comms logger and timers the config turns on; for a
   `PipelineModule`, the same engine driving the stage's pipeline executor
   (`pipe_engine.PipelineEngine`: `train_batch` / `eval_batch`).

The modules named after DeepSpeed's import paths (`pipe/`, `moe/`, `runtime/`, `utils/`, `ops/`,
`comm.py`, `zero.py`, `checkpointing.py`, `accelerator.py`, `inference.py`) are adapters; this
face re-exports them as DeepSpeed's module attributes, and nothing else in the engine imports
them (docs/architecture.md).

Reading order: `config/` (the ds_config) → `engine.py` (the loop) → `steps.py` and this file
(the order) → `composition.py` (the record).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

import minispeed.comm
import minispeed.moe
import minispeed.pipeline
import minispeed.tensor_parallel
from minispeed.core.config import ConfigError
from minispeed.engine import steps
from minispeed.engine.agreement import agree_on_inputs
from minispeed.engine.composition import Composition
from minispeed.engine.config import EngineConfig, load_ds_config
from minispeed.engine.distributed import add_config_arguments, init_distributed
from minispeed.engine.engine import Engine
from minispeed.engine.experts import MoEEngine, broadcast_frozen, expert_replica_groups
from minispeed.engine.grid import (
    build_grid,
    check_mics_size,
    check_optimizer,
    grid_shape,
    tensor_parallel_size,
)
from minispeed.engine.pipe_engine import PipelineEngine
from minispeed.engine.sequence_groups import check_sequence_grid, sequence_parallel_size
from minispeed.engine.steps import record_config, record_grid
from minispeed.engine.tune.trial import Trial, TrialRecorder
from minispeed.engine.version import __version__ as __version__

# DeepSpeed's module attributes and names (`deepspeed.comm`, `deepspeed.zero.Init`,
# `deepspeed.init_inference`, `deepspeed.DeepSpeedEngine`, ...): adapters over the packages,
# re-exported here only.
from minispeed.engine import (  # isort: skip
    accelerator,
    checkpointing,
    comm,
    git_version_info,
    moe,
    ops,
    pipe,
    runtime,
    utils,
    zero,
)
from minispeed.engine.accelerator import get_accelerator  # isort: skip
from minispeed.engine.inference import InferenceEngine, init_inference  # isort: skip
from minispeed.engine.moe.groups import configure_moe_param_groups as _moe_groups  # isort: skip
from minispeed.engine.moe.groups import holds_experts as _holds_experts  # isort: skip
from minispeed.engine.pipe import PipelineModule  # isort: skip
from minispeed.engine.runtime.config import DeepSpeedConfig, DeepSpeedConfigError  # isort: skip
from minispeed.engine.runtime.engine import DeepSpeedEngine  # isort: skip
from minispeed.engine.runtime.zero.parameter_offload import DeepSpeedZeRoOffload as _ZeroOffload  # isort: skip
from minispeed.engine.runtime.tensor_parallel import (  # isort: skip
    batch_over_data,
    merge_recorded,
    recorded_for,
    tp_model_init,
)
from minispeed.engine.utils import OnDevice, log_dist, logger  # isort: skip

__all__ = [
    "ConfigError",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "Engine",
    "EngineConfig",
    "InferenceEngine",
    "OnDevice",
    "PipelineEngine",
    "PipelineModule",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "get_accelerator",
    "git_version_info",
    "init_distributed",
    "init_inference",
    "initialize",
    "log_dist",
    "logger",
    "moe",
    "ops",
    "pipe",
    "runtime",
    "tp_model_init",
    "utils",
    "zero",
]


def _config_from(args: Any, config: Any, config_params: Any) -> dict[str, Any]:
    """DeepSpeed's precedence: `config`, else `config_params`, else `args.deepspeed_config`
    (`args.deepscale_config`, its old name); two given is an error."""
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ConfigError(
            "",
            "a config was given twice (args.deepspeed_config and initialize(config=...)); pass "
            "only one of them",
        )
    config = config if config is not None else from_args
    if config is None:
        raise ConfigError(
            "",
            "initialize() needs a config: pass config= (a dict or a path) or args with "
            "--deepspeed_config",
        )
    return load_ds_config(config)


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., Any] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: str | os.PathLike | Mapping[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | os.PathLike | Mapping[str, Any] | None = None,
    tensor_parallel_plan: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """Build the engine: returns `(engine, optimizer, training_dataloader, lr_scheduler)`.

    `optimizer` and `lr_scheduler` may be objects or callables (of the parameters, of the
    optimizer), as DeepSpeed accepts; without them the config's `optimizer` / `scheduler`
    sections are built by name. `training_data` (a dataset) gets a distributed loader of
    `train_micro_batch_size_per_gpu` samples per data-parallel rank. A `PipelineModule` yields
    a pipeline engine (`train_batch` / `eval_batch`).

    `tensor_parallel_plan` (minispeed's keyword, read when `tensor_parallel.autotp_size` > 1):
    a `minispeed.tensor_parallel.Plan` or a callable of the module (of the stage, for a
    pipeline) returning one; `None` picks a ready plan by the model's type
    (`minispeed.tensor_parallel.ready_plan`): for minispeed's GPT, GPT-2 and LLaMA the output
    head gives each tensor rank its vocabulary slice of the logits (take the loss with
    `minispeed.tensor_parallel.vocab_parallel_cross_entropy(logits, targets, engine.grid)`);
    any other model, and any model given to `tp_model_init` first (the Trainer's path), is cut
    by its structure (`minispeed.tensor_parallel.auto_plan`), its logits whole.
    """
    if model is None or not isinstance(model, nn.Module):
        raise TypeError(f"initialize() needs model= (an nn.Module), got {type(model).__name__}")
    if mesh_param is not None:
        raise ValueError(
            "mesh_param= is not supported: minispeed builds its process grid from the config "
            "(pipeline stages x data x tensor_parallel.autotp_size, or data x "
            "sequence_parallel_size); remove it"
        )
    # 1. The whole config, checked locally on every rank before any collective.
    composition = Composition()
    ds = _config_from(args, config, config_params)
    is_pipeline = isinstance(model, minispeed.pipeline.PipelineModule)
    trial = Trial.from_env()
    if trial is not None:  # a `minispeed tune` trial: its config replaces the script's
        if is_pipeline:
            raise ConfigError(
                "<trial>", "minispeed tune does not tune pipeline models; run it without a pipeline"
            )
        ds = load_ds_config(trial.config)
    # 2. The process group, and the grid's shape (checked on every rank before any collective);
    # a pipeline brings its own grid (pipe × data [× tensor]).
    init_distributed(distributed_port=distributed_port)
    # transformers' Trainer records the tensor-parallel size with `tp_model_init` first: merged
    # into the config here, and the model cut by its structure (whole logits) in step 3.
    if not is_pipeline:
        ds = merge_recorded(ds, model)
        if tensor_parallel_plan is None and recorded_for(model):
            tensor_parallel_plan = minispeed.tensor_parallel.auto_plan
    # Every rank's config and model the same (agreement.py): a difference named by key, on every
    # rank, before the first collective that depends on it.
    agree_on_inputs(ds, None if is_pipeline else model)
    tensor = tensor_parallel_size(ds)  # before EngineConfig: its data-parallel size needs T
    if not is_pipeline:  # a batch counted over every rank, as DeepSpeed's AutoTP counts it
        ds = batch_over_data(ds, minispeed.comm.get_world_size(), tensor)
    # S, from the config or DeepSpeed's `mpu=` (parallel_state_sp): data x sequence only
    sequence = sequence_parallel_size(ds, mpu)
    pipe = model.stages if is_pipeline else 1
    shape = grid_shape(minispeed.comm.get_world_size(), pipe, tensor, sequence)
    # Every key checked, with the grid's data-parallel size (and a pipeline's stage count, which
    # the `pipeline` section's "auto" stages means).
    cfg = EngineConfig.from_ds_config(
        ds, data_parallel_size=shape["data"], pipeline_stages=model.stages if is_pipeline else None
    )
    if sequence > 1:  # the mpu's S, when the config left the key out
        cfg = dataclasses.replace(cfg, sequence_parallel_size=sequence)
    has_experts = bool(minispeed.moe.moe_layers(model))
    check_sequence_grid(sequence, pipe, tensor, has_experts, cfg.zero.mics_shard_size)
    record_config(composition, cfg, "trial" if trial is not None else "ds_config")
    # MiCS's S against the data axis (and, to train, against the other axes)
    trains = optimizer is not None or cfg.optimizer is not None or is_pipeline
    check_mics_size(shape, cfg.zero.mics_shard_size, trains=trains)
    if is_pipeline:
        steps.check_pipeline(model, cfg, has_experts)
        _check_pipeline_grid(model.grid, shape)
    grid = model.grid if is_pipeline else build_grid(shape) if tensor > 1 else None
    record_grid(composition, shape, grid)
    # Sequence parallelism: the registry's data x sequence grid (the mpu's, or built now); ZeRO
    # then runs over the world, the sequence-data group (sequence_groups.py).
    sequence_grid = steps.sequence_grid(composition, sequence) if sequence > 1 else None
    # 3. The tensor-parallel plan, applied to the model (each pipeline stage) and agreed by every
    # rank, before the optimizer sees the parameters.
    if tensor > 1:
        optimizer, model_parameters = steps.tensor_parallel_plan(
            composition, model, tensor_parallel_plan, grid, per_stage=is_pipeline,
            optimizer=optimizer, model_parameters=model_parameters,
        )  # fmt: skip
    # 4. Activation checkpointing, for model code that calls `deepspeed.checkpointing.checkpoint`.
    if cfg.activation_checkpointing is not None:
        with composition.step("activation checkpointing", keys=("activation_checkpointing",)) as s:
            # partition_activations splits the kept inputs over the grid's tensor axis
            checkpointing.apply(cfg.activation_checkpointing, grid if tensor > 1 else None)
            s.did("deepspeed.checkpointing.checkpoint configured (for model code that calls it)")
    # A `minispeed tune` trial's recorder counts the model before anything is partitioned.
    recorder = None if trial is None else TrialRecorder(trial, model)
    # 5. The optimizer; on a grid, an error on one rank is raised on every rank, before ZeRO's
    # first collective (minispeed.tensor_parallel.agreed).
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if optimizer is None and cfg.optimizer is not None and _holds_experts(params):
        # as DeepSpeed, for the optimizer it builds: the experts' parameters in groups of their own
        params = _moe_groups(params)
    if grid is None:
        opt = steps.build_optimizer(composition, optimizer, params, cfg)
    else:
        ties = model.tied_grad_groups() if is_pipeline else None
        opt = minispeed.tensor_parallel.agreed(
            lambda: check_optimizer(
                steps.build_optimizer(composition, optimizer, params, cfg), model, grid, ties
            )
        )
    # 6. ZeRO over the data-parallel group (stage 0 is plain data parallelism; precision and
    # offload inside it); MoE experts over their expert-data group (experts.py); the grid's
    # other axes as ZeRO's model-parallel axes (the norm and the fp16 verdict over the whole
    # model, tied gradients summed over their stages).
    zero_opt, replica_groups, forward_only = None, None, None
    if opt is not None:
        replica_groups = expert_replica_groups(model, opt.param_groups)
        if grid is not None and replica_groups is not None:
            raise NotImplementedError(
                "tensor_parallel.autotp_size > 1 with MoE layers is not supported: the experts' "
                "groups are built over the world, not inside the grid's data axis; use one of them"
            )
        if replica_groups is not None:  # what zero.shard cannot tell apart (experts.py)
            broadcast_frozen(model, opt.param_groups)
        ties = model.tied_grad_groups() if is_pipeline else None
        zero_opt = steps.shard(
            composition, model, opt, cfg, grid=grid, replica_groups=replica_groups, ties=ties
        )
    elif cfg.zero.stage == 3 and not is_pipeline:
        # Note [stage 3 without an optimizer]: DeepSpeed's ZeRO-Inference.
        forward_only = steps.shard_forward_only(composition, model, cfg, grid=grid)
    # 7. The scheduler, on the optimizer whose param groups hold the hyper-parameters.
    scheduler = steps.build_scheduler(composition, lr_scheduler, zero_opt, cfg)
    loader = steps.dataloader(
        composition, training_data, cfg, collate_fn, grid or sequence_grid, for_pipeline=is_pipeline
    )
    # 8. The engine, with the profiler, comms logger and timers it reads from the config; a
    # pipeline's drives its stage's executor. (MoEEngine: Note [expert checkpoints until the
    # layout names experts] in experts.py.)
    observers: list[Any] = [] if recorder is None else [recorder]
    schedule = steps.compression_schedule(composition, model, cfg)
    if schedule is not None:  # switches compression techniques on as optimizer steps apply
        observers.append(schedule)
    arguments = steps.forward_arguments(composition, cfg, is_pipeline=is_pipeline)
    if is_pipeline:
        executor = steps.pipeline_executor(composition, model, zero_opt, cfg)
        engine = PipelineEngine(
            model, zero_opt, cfg, scheduler, executor=executor, observers=observers,
            composition=composition,
        )  # fmt: skip
        if loader is not None:
            engine.set_dataloader(loader)
        return engine, zero_opt, loader, scheduler
    engine_class = Engine if replica_groups is None else MoEEngine
    engine = engine_class(
        model, zero_opt, cfg, scheduler, loader, observers=observers, grid=grid,
        composition=composition,
    )  # fmt: skip
    engine.forward_only_zero = forward_only  # kept alive with the engine; destroy() closes it
    engine.forward_arguments = arguments
    if zero_opt is not None and cfg.zero.stage == 3:  # what TRL strips around generate
        zero_opt.parameter_offload = _ZeroOffload(model)
    return engine, zero_opt, loader, scheduler


# Note [stage 3 without an optimizer]
# `deepspeed.initialize(model=model, config=...)` with ZeRO stage 3 and no optimizer is how
# DeepSpeed runs ZeRO-Inference (transformers' docs: `engine.module.generate(...)` on a model
# too large for one device): DeepSpeed builds its parameter-offload half of stage 3, which
# partitions the model and gathers each module's parameters around its forward. A model built
# under `zero.Init` (what `from_pretrained` does under HfDeepSpeedConfig) holds only shards and
# cannot run without it. minispeed gets the same from `zero.shard(model, None, ...)`
# (`steps.shard_forward_only`; the zero package's stage3/forward_only.py): the engine has no
# optimizer (`engine.optimizer` is None, and `backward` / `step` are refused as with any engine
# built without one), the shards are `engine.forward_only_zero`. A training config's
# `offload_optimizer` is left out (no optimizer state); `offload_param` applies. Cost per rank:
# the parameter shards alone, p·Ψ/N bytes (2Ψ/N in bf16/fp16; no fp32 master, no gradient),
# and one all-gather of each module's parameters per forward.


def _check_pipeline_grid(grid: Any, shape: dict[str, int]) -> None:
    """The PipelineModule's grid must have the config's tensor-parallel size (local)."""
    has = grid.size("tensor") if "tensor" in grid.topology.axes else 1
    if has != shape["tensor"]:
        raise ConfigError(
            "tensor_parallel.autotp_size",
            f"the config asks for {shape['tensor']} tensor-parallel ranks but the PipelineModule's "
            f"grid has {has}: build it with topology=minispeed.engine.pipe."
            f"PipeModelDataParallelTopology(num_pp={shape['pipe']}, num_mp={shape['tensor']}, "
            f"num_dp={shape['data']}) (or set autotp_size to {has})",
        )
