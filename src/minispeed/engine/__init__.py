"""minispeed.engine: DeepSpeed's API over minispeed's packages, so a DeepSpeed script runs with
its import line changed (`import minispeed.engine as deepspeed`).

```python
import minispeed.engine as deepspeed
engine, optimizer, loader, scheduler = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config="ds_config.json")
```

`initialize` composes the packages in one fixed order (each step selected by the config):

1. read and check the whole config on every rank (no collective yet): `EngineConfig` (under
   `minispeed tune`, `MINISPEED_TRIAL`'s config replaces the script's and the engine ends the
   job after the trial's steps: `trial.py`);
2. `init_distributed` (torchrun's environment, or a single process); the grid's shape (pipe ×
   data × tensor, `grid.py`), checked before any collective; with
   `tensor_parallel.autotp_size` > 1 the grid's groups and the tensor-parallel plan applied to
   the model (or to each pipeline stage), agreed by every rank (`tensor_plan.py`);
3. the optimizer: the one given, a callable of the parameters, or the config's by name;
4. `zero.shard` over the data-parallel group (stage, precision, offload, ZeRO++), the experts of
   `MoE` layers over their expert-data group (`moe/compose.py`);
5. the scheduler: the one given, a callable of the optimizer, or the config's by name;
6. the engine (`Engine`), with the profiler, comms logger and timers the config turns on.

The `activation_checkpointing` section configures `minispeed.engine.checkpointing` (DeepSpeed's
`deepspeed.checkpointing`) for model code that calls its `checkpoint`; a `PipelineModule` goes to
the pipeline engine after step 2 (`pipe_engine.PipelineEngine`).

Reading order: `config.py` (the ds_config) → `engine.py` (the loop) → this file (the order).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

import minispeed.comm as _comm
from minispeed.core.config import ConfigError
from minispeed.core.logging import get_logger
from minispeed.engine import (
    accelerator,
    checkpointing,
    comm,
    moe,
    ops,
    pipe,
    runtime,
    tensor_plan,
    utils,
    zero,
)
from minispeed.engine.accelerator import get_accelerator
from minispeed.engine.config import EngineConfig, load_ds_config
from minispeed.engine.engine import Engine, zero_config_for
from minispeed.engine.grid import build_grid, grid_shape, tensor_parallel_size
from minispeed.engine.inference import init_inference
from minispeed.engine.moe.compose import expert_replica_groups
from minispeed.engine.moe.engine import MoEEngine
from minispeed.engine.pipe import PipelineModule
from minispeed.engine.pipe_engine import PipelineEngine
from minispeed.engine.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from minispeed.engine.runtime.engine import DeepSpeedEngine
from minispeed.engine.runtime.tensor_parallel import tp_model_init
from minispeed.engine.trial import Trial
from minispeed.engine.utils import OnDevice, log_dist, logger
from minispeed.zero import shard

__all__ = [
    "ConfigError",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "Engine",
    "EngineConfig",
    "OnDevice",
    "PipelineEngine",
    "PipelineModule",
    "accelerator",
    "add_config_arguments",
    "checkpointing",
    "comm",
    "get_accelerator",
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

_log = get_logger("engine")


def _version() -> str:
    # Scripts print or compare `deepspeed.__version__`; the import-swapped module answers with
    # minispeed's own version (a source checkout without installed metadata says so).
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("minispeed")
    except PackageNotFoundError:
        return "0.0.0+source"


__version__ = _version()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    verbose: bool = True,
    timeout: Any = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Start the default process group (DeepSpeed's signature): from torchrun's environment,
    or from an explicit rendezvous (`init_method="file://..."` or `"tcp://..."` with `rank`
    and `world_size`, as torch's `init_process_group` takes them).

    `dist_backend=None` picks the accelerator's (gloo on CPU, nccl on GPU); without torchrun's
    variables or an explicit rank a single-process group starts. MPI discovery is not used.
    """
    if distributed_port is not None and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)
    if timeout is None:
        timeout_s = 300.0
    elif hasattr(timeout, "total_seconds"):  # DeepSpeed passes a datetime.timedelta
        timeout_s = timeout.total_seconds()
    else:
        timeout_s = float(timeout)
    _comm.init_distributed(
        backend=dist_backend,
        timeout_s=timeout_s,
        init_method=init_method,
        rank=None if rank == -1 else rank,
        world_size=None if world_size == -1 else world_size,
    )


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed` and `--deepspeed_config` flags to `parser`."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (minispeed)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="ds_config.json path")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


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
    pipeline) returning one; `None` picks a ready plan by the model's type (`tensor_plan.py`).
    The split model's output head gives each tensor rank its vocabulary slice of the logits:
    take the loss with `minispeed.tensor_parallel.vocab_parallel_cross_entropy(logits,
    targets, engine.grid)`.
    """
    if model is None or not isinstance(model, nn.Module):
        raise TypeError(f"initialize() needs model= (an nn.Module), got {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise ValueError(
            "mpu= and mesh_param= are not supported: minispeed builds its process grid from the "
            "config (pipeline stages x data x tensor_parallel.autotp_size); remove them"
        )
    # 1. The whole config, checked locally on every rank before any collective.
    ds = _config_from(args, config, config_params)
    is_pipeline = isinstance(model, _pipeline_module_type())
    trial = Trial.from_env()
    if trial is not None:  # a `minispeed tune` trial: its config replaces the script's
        if is_pipeline:
            raise ConfigError(
                "<trial>", "minispeed tune does not tune pipeline models; run it without a pipeline"
            )
        ds = load_ds_config(trial.config)
    # 2. The process group, and the grid's shape (checked on every rank before any collective).
    init_distributed(distributed_port=distributed_port)
    world = _comm.get_world_size()
    tensor = tensor_parallel_size(ds)
    stages = model.num_stages if is_pipeline else 1
    shape = grid_shape(world, stages, tensor)
    if ds.get("activation_checkpointing") is not None:
        # For model code that calls `deepspeed.checkpointing.checkpoint` (this path's adapter).
        checkpointing.configure(None, deepspeed_config=ds)
    if is_pipeline:
        return _initialize_pipeline(
            model, optimizer, model_parameters, lr_scheduler, ds, training_data,
            shape, tensor_parallel_plan,
        )  # fmt: skip
    cfg = EngineConfig.from_ds_config(ds, data_parallel_size=shape["data"])
    # The grid (data × tensor) and the tensor-parallel plan (tensor_plan.py), before the
    # optimizer sees the parameters.
    grid = None
    if tensor > 1:
        grid = build_grid(shape)
        optimizer, model_parameters = tensor_plan.cut(
            model, tensor_parallel_plan, grid, per_stage=False,
            optimizer=optimizer, model_parameters=model_parameters,
        )  # fmt: skip
    # 3. The optimizer.
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    opt = _build_optimizer(optimizer, params, cfg)
    # 4. ZeRO over the data-parallel group (stage 0 is plain data parallelism); MoE experts over
    # their expert-data group, divided by the data-parallel size (moe/compose.py); the tensor
    # axis as ZeRO's model-parallel axis (the norm and the fp16 verdict over the whole model).
    zero_opt, replica_groups = None, None
    if opt is not None:
        replica_groups = expert_replica_groups(model, opt.param_groups)
        if grid is not None and replica_groups is not None:
            raise NotImplementedError(
                "tensor_parallel.autotp_size > 1 with MoE layers is not supported: the experts' "
                "groups are built over the world, not inside the grid's data axis; use one of them"
            )
        parallel = {}
        if grid is not None:
            parallel = {
                "group": grid.group("data"),
                "model_parallel": tensor_plan.model_parallel(model, grid),
            }
        zero_opt = shard(
            model, opt, config=zero_config_for(cfg, opt), precision=cfg.precision,
            replica_groups=replica_groups,
            allow_untested_optimizer=bool(cfg.raw.get("zero_allow_untested_optimizer", False)),
            **parallel,
        )  # fmt: skip
    # 5. The scheduler, on the optimizer whose param groups hold the hyper-parameters.
    scheduler = _build_scheduler(lr_scheduler, zero_opt, cfg)
    loader = _dataloader(training_data, cfg, collate_fn, grid)
    # 6. The engine, with the profiler, comms logger and timers it reads from the config.
    # (MoEEngine: Note [expert checkpoints until the layout names experts] in moe/engine.py.)
    engine_class = Engine if replica_groups is None else MoEEngine
    engine = engine_class(model, zero_opt, cfg, scheduler, loader, trial=trial, grid=grid)
    return engine, zero_opt, loader, scheduler


def _build_optimizer(given: Any, params: list[Any], cfg: EngineConfig) -> Any:
    if isinstance(given, torch.optim.Optimizer):
        if cfg.optimizer is not None:
            _log.warning(
                'initialize(optimizer=%s) and the config\'s "optimizer" section were both given; '
                "the optimizer object is used, as DeepSpeed does (remove the section to silence this)",
                type(given).__name__,
            )
        return given
    if given is not None:
        return _called(given, params, "optimizer= must be a torch.optim.Optimizer or a callable "
                       "of the model parameters")  # fmt: skip
    if cfg.optimizer is None:
        return None
    from minispeed.engine.optim import build_optimizer

    return build_optimizer(cfg.optimizer, params)


def _called(given: Any, argument: Any, accepts: str) -> Any:
    """`given(argument)` for DeepSpeed's `optimizer=` / `lr_scheduler=` callables; a TypeError
    saying what the keyword `accepts` when `given` is not callable."""
    if not callable(given):
        raise TypeError(f"{accepts}, got {type(given).__name__}")
    return given(argument)


def _build_scheduler(given: Any, zero_opt: Any, cfg: EngineConfig) -> Any:
    if given is not None and hasattr(given, "step"):  # a scheduler object, already attached
        return given
    # The inner optimizer's param groups hold the hyper-parameters the step reads (a pipeline
    # engine's optimizer is the torch optimizer itself).
    target = getattr(zero_opt, "optimizer", zero_opt)
    if given is not None:  # DeepSpeed's scheduler callable: it gets the optimizer
        return _called(given, target, "lr_scheduler= must be a scheduler or a callable of the "
                       "optimizer")  # fmt: skip
    if cfg.scheduler is None:
        return None
    if target is None:
        raise ConfigError("scheduler", "a scheduler needs an optimizer; add an optimizer section")
    from minispeed.engine.lr_schedules import build_scheduler

    return build_scheduler(cfg.scheduler, target)


def _dataloader(dataset: Any, cfg: EngineConfig, collate_fn: Any, grid: Any = None) -> Any:
    """DeepSpeed's loader: a `DistributedSampler` over the data-parallel ranks (shuffled with
    seed 0), `train_micro_batch_size_per_gpu` samples per batch; the tensor ranks of one
    replica read the same samples."""
    if dataset is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler

    rank = _comm.get_rank() if grid is None else grid.rank_in("data")
    sampler = DistributedSampler(dataset, num_replicas=cfg.data_parallel_size, rank=rank)
    return DataLoader(
        dataset, batch_size=cfg.micro_batch_size, sampler=sampler, collate_fn=collate_fn
    )


def _pipeline_module_type() -> type:
    from minispeed.engine.pipe import PipelineModule

    return PipelineModule


def _initialize_pipeline(
    model: Any,
    optimizer: Any,
    model_parameters: Any,
    lr_scheduler: Any,
    ds: dict,
    data: Any,
    shape: dict[str, int],
    plan: Any,
) -> tuple[Any, Any, Any, Any]:
    """A `PipelineModule`: the pipeline engine over the module's (pipe, data[, tensor]) grid,
    its stage cut by the tensor-parallel plan when `tensor_parallel.autotp_size` > 1."""
    if data is not None:
        raise ValueError(
            "training_data= with a PipelineModule is not supported: pass a data iterator to "
            "engine.train_batch(data_iter)"
        )
    grid = model.grid
    has = grid.size("tensor") if "tensor" in grid.topology.axes else 1
    if has != shape["tensor"]:
        raise ConfigError(
            "tensor_parallel.autotp_size",
            f"the config asks for {shape['tensor']} tensor-parallel ranks but the PipelineModule's "
            f"grid has {has}: build it with topology=minispeed.engine.pipe."
            f"PipeModelDataParallelTopology(num_pp={shape['pipe']}, num_mp={shape['tensor']}, "
            f"num_dp={shape['data']}) (or set autotp_size to {has})",
        )
    # Every key checked as for any model, with the data-parallel size of the grid.
    cfg = EngineConfig.from_ds_config(ds, data_parallel_size=shape["data"])
    if shape["tensor"] > 1:  # the stage's layers cut by the plan, before the optimizer
        optimizer, model_parameters = tensor_plan.cut(
            model,
            plan,
            grid,
            per_stage=True,
            optimizer=optimizer,
            model_parameters=model_parameters,
        )
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    opt = _build_optimizer(optimizer, params, cfg)
    scheduler = _build_scheduler(lr_scheduler, opt, cfg)
    # See Note [DeepSpeed clips at 1.0 by default] in engine/config.
    resolved = {**ds, "gradient_clipping": cfg.zero.max_grad_norm}
    engine = PipelineEngine(model, opt, resolved, scheduler)
    return engine, engine.optimizer, None, scheduler  # ZeRO's under zero_optimization or 16-bit
