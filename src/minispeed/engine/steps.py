"""The steps of `initialize`, one function each, in the order it calls them (docs/architecture.md,
"The composition order"); each records what it did into the `Composition` (`composition.py`),
which `engine.describe()` prints.

`initialize` (the engine's face) orders these calls; `PipelineEngine(module, optimizer,
ds_config)`, the pipeline engine built without `initialize`, calls the same ones from the
optimizer on. Every function is local unless it says it is collective; a collective one is
called by every rank with the same arguments.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
import minispeed.compression as compression
import minispeed.engine.sequence_groups as sequence_groups
import minispeed.pipeline as pipeline
import minispeed.tensor_parallel as tensor_parallel
import minispeed.zero as zero
from minispeed.core.config import ConfigError
from minispeed.core.logging import get_logger
from minispeed.engine.composition import Composition, placements
from minispeed.engine.config import EngineConfig
from minispeed.engine.engine import zero_config_for
from minispeed.engine.grid import mics_groups, model_parallel
from minispeed.engine.legacy import ForwardArguments
from minispeed.tensor_parallel.sharding import sharded_parameters

__all__ = [
    "build_optimizer",
    "build_scheduler",
    "dataloader",
    "pipeline_executor",
    "record_config",
    "record_grid",
    "shard",
    "shard_forward_only",
    "tensor_parallel_plan",
]

_log = get_logger("engine")


def record_config(composition: Composition, cfg: EngineConfig, source: str) -> None:
    """Step 1's record: the batch triple and the sections the config turned on."""
    with composition.step("config", keys=(source,)) as step:
        step.did(
            f"train_batch_size {cfg.train_batch_size} = micro-batch {cfg.micro_batch_size} x "
            f"accumulation {cfg.gradient_accumulation_steps} x data-parallel "
            f"{cfg.data_parallel_size}; checked on every rank before any collective"
        )
        on = [_precision_key(cfg)] if _precision_key(cfg) else []
        on += ["flops_profiler"] if cfg.flops_profiler.enabled else []
        on += ["comms_logger"] if cfg.comms_logger.enabled else []
        on += ["wall_clock_breakdown"] if cfg.wall_clock_breakdown else []
        on += ["steps_per_print"] if cfg.steps_per_print else []
        if on:
            step.did(f"sections that change the run: {', '.join(on)}")


def record_grid(composition: Composition, shape: dict[str, int], grid: Any) -> None:
    """Step 2's record: the world's shape and this rank's groups."""
    keys = ["tensor_parallel.autotp_size"] if shape["tensor"] > 1 else []
    keys += ["PipelineModule(num_stages)"] if shape["pipe"] > 1 else []
    with composition.step("process group and grid", keys=keys) as step:
        world = comm.get_world_size()
        step.did(
            f"world {world} = pipe {shape['pipe']} x data {shape['data']} x tensor "
            f"{shape['tensor']}; this is global rank {comm.get_rank()}"
        )
        if grid is None:
            step.did("no grid: the world is the data-parallel group")
            return
        for axis in grid.topology.axes:
            step.did(f"{axis} group of this rank: ranks {list(grid.group_ranks(axis))}")


def sequence_grid(composition: Composition, sequence: int) -> comm.ProcessGrid:
    """Step 2 under sequence parallelism: the registry's data x sequence grid, built now unless
    `parallel_state_sp.initialize_sequence_parallel` built it (collective then: every rank)."""
    with composition.step("sequence-parallel groups", keys=("sequence_parallel_size",)) as step:
        groups = sequence_groups.current()
        if groups is None:
            groups = sequence_groups.initialize_sequence_parallel(sequence)
            step.did(f"built data {groups.data_parallel_size} x sequence {sequence}")
        elif groups.sequence_parallel_size != sequence:
            raise ConfigError(
                "sequence_parallel_size",
                f"{sequence}, but initialize_sequence_parallel built groups of "
                f"{groups.sequence_parallel_size}; make them equal",
            )
        else:
            step.did(f"the initialized data {groups.data_parallel_size} x sequence {sequence}")
        grid = groups.grid
        step.did(f"sequence group of this rank: ranks {list(grid.group_ranks('sequence'))}")
        step.did(
            "ZeRO over all ranks (the sequence-data group); gradients summed over the sequence "
            f"axis and averaged over the {groups.data_parallel_size} data ranks"
        )
        return grid


def tensor_parallel_plan(
    composition: Composition,
    model: nn.Module,
    plan: Any,
    grid: Any,
    *,
    per_stage: bool,
    optimizer: Any,
    model_parameters: Any,
) -> tuple[Any, Any]:
    """Step 3: the plan chosen, applied and agreed by every rank (collective over the world:
    `minispeed.tensor_parallel.parallelize_everywhere`), before the optimizer sees the
    parameters. Returns `(optimizer, model_parameters)` pointed at the slices. A model built
    under `zero.Init` (its parameters already ZeRO-3 shards) is refused, naming a parameter:
    the cut needs whole weights (local: every rank raises before the first collective)."""
    from minispeed.zero.stage3.params import REGISTRY

    partitioned = next((n for n, p in model.named_parameters() if p in REGISTRY), None)
    if partitioned is not None:
        raise ConfigError(
            "tensor_parallel.autotp_size",
            f"the model's parameters are ZeRO-3 shards already ({partitioned!r}: built under "
            "zero.Init, or from_pretrained with a stage-3 HfDeepSpeedConfig) and tensor "
            "parallelism cuts whole weights: build the model outside zero.Init (initialize "
            "then partitions the slices at stage 3)",
        )
    with composition.step(
        "tensor-parallel plan", model, keys=("tensor_parallel.autotp_size",)
    ) as step:
        optimizer, model_parameters = tensor_parallel.parallelize_everywhere(
            model, plan, grid, per_stage=per_stage, optimizer=optimizer,
            model_parameters=model_parameters,
        )  # fmt: skip
        split = sharded_parameters(model)
        step.did(
            f"{len(split)} parameters split over the tensor group of {grid.size('tensor')} "
            "ranks (the modules replaced are listed below); every rank agreed"
        )
    return optimizer, model_parameters


def build_optimizer(
    composition: Composition, given: Any, params: list[Any], cfg: EngineConfig
) -> Any:
    """Step 5: the optimizer given, a callable of the parameters, or the config's by name."""
    with composition.step("optimizer") as step:
        opt = _optimizer(given, params, cfg)
        if opt is None:
            step.did("none: no optimizer given and no optimizer section (forward only)")
            return None
        if given is not None:
            _check_host_optimizer(opt, cfg)
        if isinstance(given, torch.optim.Optimizer):
            step.keys = ("initialize(optimizer=...)",)
        elif given is not None:
            step.keys = ("initialize(optimizer=<callable>)",)
        else:
            step.keys = ("optimizer.type", "optimizer.params")
        hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        shown = ", ".join(f"{k}={hyper[k]}" for k in ("lr", "betas", "weight_decay") if k in hyper)
        numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
        step.did(
            f"{type(opt).__module__}.{type(opt).__name__} ({shown}) over "
            f"{len(opt.param_groups)} param groups, {numel:,} elements"
        )
        return opt


def _check_host_optimizer(opt: Any, cfg: EngineConfig) -> None:
    """`zero_force_ds_cpu_optimizer`, as DeepSpeed 0.19.8's (true by default): with the
    optimizer offloaded (`offload_optimizer.device` cpu or nvme), an optimizer the script passes
    must be offload's `CPUAdam` (or a subclass: `CPUAdamW`, DeepSpeed's `DeepSpeedCPUAdam`) or
    `CPULion`, as DeepSpeed accepts only its `DeepSpeedCPUAdam` and `DeepSpeedCPULion` (its CPU
    Adagrad is refused too); false lets offload step a torch Adam, AdamW or Adagrad with its CPU kernels
    (`zero.offload_bridge.host_optimizer`). Checked on every rank, before any collective."""
    where = cfg.zero.offload_optimizer
    if where is None or where.device == "none" or not cfg.zero_force_ds_cpu_optimizer:
        return
    from minispeed import offload

    if isinstance(opt, offload.CPUAdam | offload.CPULion):
        return
    raise ConfigError(
        "zero_force_ds_cpu_optimizer",
        f"true (DeepSpeed's default) refuses the optimizer passed to initialize(), "
        f"{type(opt).__name__}, under zero_optimization.offload_optimizer.device "
        f"{where.device!r}: pass minispeed.offload.CPUAdam or CPULion (DeepSpeed's "
        f'DeepSpeedCPUAdam), name the optimizer in the config\'s "optimizer" section, or set '
        f"zero_force_ds_cpu_optimizer to false to have offload step {type(opt).__name__} with "
        f"its CPU kernel",
    )


def _optimizer(given: Any, params: list[Any], cfg: EngineConfig) -> Any:
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
    from minispeed.engine.optim import build_optimizer as by_name

    return by_name(cfg.optimizer, params)


def _called(given: Any, argument: Any, accepts: str) -> Any:
    """`given(argument)` for DeepSpeed's `optimizer=` / `lr_scheduler=` callables; a TypeError
    saying what the keyword `accepts` when `given` is not callable."""
    if not callable(given):
        raise TypeError(f"{accepts}, got {type(given).__name__}")
    return given(argument)


def shard(
    composition: Composition,
    model: nn.Module,
    opt: Any,
    cfg: EngineConfig,
    *,
    grid: Any = None,
    replica_groups: list[Any] | None = None,
    ties: list[tuple[nn.Parameter, Any, bool]] | None = None,
) -> zero.ZeroOptimizer:
    """Step 6: `zero.shard` over the data axis (collective over the data group and the grid):
    stage 0 is plain data parallelism; `replica_groups` (MoE experts) reduce their param groups
    over their expert-data group; the grid's other axes (pipe, tensor) are ZeRO's
    `ModelParallel`, so the gradient norm and the fp16 verdict are the whole model's and tied
    gradients are summed over their stages (`ties`: a pipeline's `tied_grad_groups()`)."""
    zero_config = zero_config_for(cfg, opt)
    keys = ["zero_optimization.stage", "gradient_clipping"]
    keys += [_precision_key(cfg)] if _precision_key(cfg) else []
    keys += [f"zero_optimization.{k}" for k in ("offload_optimizer", "offload_param")
             if getattr(cfg.zero, k) is not None]  # fmt: skip
    parallel: dict[str, Any] = {}
    if grid is not None:
        parallel = {
            "group": grid.group("data"),
            "model_parallel": model_parallel(model, grid, ties or []),
        }
    if zero_config.stage == 3 and zero_config.mics_shard_size > 0:  # built once, from the grid
        keys.append("zero_optimization.mics_shard_size")
        parallel["mics_groups"] = mics_groups(
            grid, zero_config.mics_shard_size, zero_config.mics_hierarchical_params_gather
        )
    with composition.step("zero.shard", model, keys=keys) as step:
        opt = zero.shard(
            model, opt, config=zero_config, precision=cfg.precision,
            replica_groups=replica_groups,
            allow_untested_optimizer=cfg.zero_allow_untested_optimizer,
            **parallel,
        )  # fmt: skip
        data = comm.get_world_size(opt.comm_group)
        dtype, accum = cfg.precision.param_dtype, cfg.precision.grad_accum_dtype
        line = (
            f"stage {zero_config.stage} over a data-parallel group of {data} ranks; parameters "
            f"in {_dtype(dtype)}, gradients accumulated in {_dtype(accum)}"
        )
        if dtype == torch.float16:
            line += f", fp16 dynamic loss scale from {opt.loss_scaler.scale:g}"
        step.did(line)
        clip = zero_config.max_grad_norm
        step.did(
            "gradient clipping off" if clip == 0 else
            "the global gradient norm computed, not clipped" if clip == float("inf") else
            f"gradients clipped to a global norm of {clip:g}"
        )  # fmt: skip
        if grid is not None:
            axes = [a for a in ("pipe", "tensor") if a in grid.topology.axes]
            step.did(f"norm and fp16 verdict summed over the model-parallel axes {axes}")
            if ties:
                step.did(f"{len(ties)} tied parameters summed over their stages at each step")
        if "mics_groups" in parallel:
            mics = parallel["mics_groups"]
            step.did(
                f"MiCS: partitioned inside shard groups of {mics.shard_size} ranks, replicated "
                f"over {mics.replicas} groups (gradients all-reduced across them)"
            )
        if replica_groups is not None:
            experts = sum(g is not None for g in replica_groups)
            step.did(f"{experts} param groups of MoE experts reduced over their expert-data group")
        for kind in ("offload_optimizer", "offload_param"):
            where = getattr(zero_config, kind)
            if where is not None:
                step.did(f"{kind}: {_offload_text(where)}")
        memory = zero.measure(opt, model)
        step.did(f"bytes held on this rank now: {_memory_text(memory)}")
        step.params = placements(model, opt)
    return opt


def shard_forward_only(
    composition: Composition, model: nn.Module, cfg: EngineConfig, *, grid: Any = None
) -> zero.ForwardOnly:
    """Step 6 without an optimizer at stage 3 (DeepSpeed's ZeRO-Inference): ``zero.shard(model,
    None)`` over the data axis, the parameter shards alone in the config's dtype (Note [stage 3
    without an optimizer] in minispeed/engine/__init__.py). Collective over the data group."""
    # No optimizer state to offload: a training config's offload_optimizer is left out, as
    # DeepSpeed's parameter-offload half of stage 3 leaves it (offload_param still applies);
    # and no backward for hpZ's secondary copy or qgZ's gradients (Note [ZeRO++ without an
    # optimizer] in zero's stage3/forward_only.py; qwZ still quantizes the gathers).
    z = cfg.zero
    left_out = [
        (key, why)
        for key, given, why in (
            ("offload_optimizer", z.offload_optimizer is not None, "there is no optimizer state"),
            ("zero_hpz_partition_size", z.hpz_partition_size > 1, "it serves backward's gathers"),
            ("zero_quantized_gradients", z.quantized_gradients, "there are no gradients"),
        )
        if given
    ]
    zero_config = dataclasses.replace(
        z, offload_optimizer=None, hpz_partition_size=1, quantized_gradients=False
    )
    keys = ["zero_optimization.stage"]
    keys += [_precision_key(cfg)] if _precision_key(cfg) else []
    keys += ["zero_optimization.offload_param"] if zero_config.offload_param is not None else []
    keys += ["zero_optimization.zero_quantized_weights"] if zero_config.quantized_weights else []
    parallel: dict[str, Any] = {}
    if grid is not None:
        parallel["group"] = grid.group("data")
    if zero_config.mics_shard_size > 0:
        keys.append("zero_optimization.mics_shard_size")
        parallel["mics_groups"] = mics_groups(
            grid, zero_config.mics_shard_size, zero_config.mics_hierarchical_params_gather
        )
    with composition.step("zero.shard (no optimizer)", model, keys=keys) as step:
        shards = zero.shard(model, None, config=zero_config, precision=cfg.precision, **parallel)
        data = comm.get_world_size(shards.comm_group)
        step.did(
            f"stage 3 without an optimizer over a data-parallel group of {data} ranks: parameter "
            f"shards in {_dtype(cfg.precision.param_dtype)} only (no fp32 masters, no gradients)"
        )
        for key, why in left_out:
            step.did(f"{key} left out: {why}")
        if zero_config.offload_param is not None:
            step.did(f"offload_param: {_offload_text(zero_config.offload_param)}")
        memory = zero.measure(shards, model)
        step.did(f"bytes held on this rank now: {_memory_text(memory)}")
    return shards


def _precision_key(cfg: EngineConfig) -> str | None:
    """The section that chose 16-bit training, if any."""
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(cfg.precision.param_dtype)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _offload_text(section: Any) -> str:
    fields = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
    device = fields.pop("device", "?")
    shown = ", ".join(f"{k}={v}" for k, v in fields.items() if v not in (None, False))
    return f"to {device}" + (f" ({shown})" if shown else "")


def _memory_text(memory: Any) -> str:
    columns = {f.name: getattr(memory, f.name) for f in dataclasses.fields(memory)}
    return ", ".join(f"{k} {v:,} B" for k, v in columns.items() if isinstance(v, int) and v)


def build_scheduler(composition: Composition, given: Any, zero_opt: Any, cfg: EngineConfig) -> Any:
    """Step 7: the scheduler given, a callable of the optimizer, or the config's by name (on the
    inner optimizer, whose param groups hold the hyper-parameters the step reads)."""
    with composition.step("scheduler") as step:
        if given is None and zero_opt is None and cfg.scheduler is not None:
            # A training config reused without an optimizer (transformers' evaluate-only
            # Trainer removes the optimizer section, not the scheduler): DeepSpeed builds no
            # scheduler then either.
            step.keys = ("scheduler.type",)
            step.did("scheduler left out: there is no optimizer to schedule")
            return None
        scheduler = _scheduler(given, zero_opt, cfg)
        if scheduler is None:
            step.did("none")
        else:
            step.keys = (
                ("initialize(lr_scheduler=...)",) if given is not None else ("scheduler.type",)
            )
            step.did(f"{type(scheduler).__module__}.{type(scheduler).__name__}")
        return scheduler


def _scheduler(given: Any, zero_opt: Any, cfg: EngineConfig) -> Any:
    if given is not None and hasattr(given, "step"):  # a scheduler object, already attached
        return given
    target = getattr(zero_opt, "optimizer", zero_opt)
    if given is not None:  # DeepSpeed's scheduler callable: it gets the optimizer
        return _called(given, target, "lr_scheduler= must be a scheduler or a callable of the "
                       "optimizer")  # fmt: skip
    if cfg.scheduler is None:
        return None
    from minispeed.engine.lr_schedules import build_scheduler as by_name

    return by_name(cfg.scheduler, target)


def compression_schedule(composition: Composition, model: Any, cfg: EngineConfig) -> Any:
    """Step 8's observer for `compression_training`: the `compression.Schedule` that switches
    each technique on at its offset (the model was compressed by `init_compression` before);
    None when no technique is enabled."""
    if not cfg.compression.enabled:
        return None
    with composition.step("compression schedule", model, keys=("compression_training",)) as step:
        schedule = compression.Schedule(model, cfg.compression)
        step.did(
            ", ".join(f"{t.name} from step {t.schedule_offset}" for t in cfg.compression.enabled)
        )
        return schedule


def forward_arguments(
    composition: Composition, cfg: EngineConfig, *, is_pipeline: bool
) -> ForwardArguments | None:
    """Step 8's source of the keyword arguments DeepSpeed 0.17.6's engine added to a training
    forward (`progressive_layer_drop`, the `seqlen` `curriculum_learning`: minispeed.engine.legacy);
    None when both are off. Refused on a pipeline, whose stages' forwards take no arguments."""
    layer_drop, curriculum = cfg.layer_drop, cfg.legacy_curriculum
    switches = {
        "progressive_layer_drop": layer_drop.enabled,
        "curriculum_learning": curriculum.enabled,
    }
    keys = tuple(name for name, on in switches.items() if on)
    if not keys:
        return None
    if is_pipeline:
        raise ConfigError(
            keys[0],
            "is not supported with a pipeline here (DeepSpeed 0.17.6's pipeline engine passes "
            "no forward arguments either): turn it off and truncate the micro-batches / skip "
            "layers in the PipelineModule's layers (docs/engine/migration.md)",
        )
    with composition.step("forward arguments", keys=keys) as step:
        step.did(", ".join(keys) + " arguments added to every training forward")
        return ForwardArguments(layer_drop, curriculum)


def dataloader(
    composition: Composition,
    dataset: Any,
    cfg: EngineConfig,
    collate_fn: Any,
    grid: Any = None,
    *,
    for_pipeline: bool = False,
) -> Any:
    """DeepSpeed's loader: a `DistributedSampler` over the data-parallel ranks (shuffled with
    seed 0), `train_micro_batch_size_per_gpu` samples per batch; the tensor ranks of one
    replica read the same samples. A pipeline's (`for_pipeline=True`, DeepSpeed's `PipelineEngine`)
    reads the samples in order and repeats endlessly (`RepeatingLoader`): `train_batch()` given
    no iterator reads it."""
    if dataset is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler

    rank = comm.get_rank() if grid is None else grid.rank_in("data")
    with composition.step("data loader", keys=("initialize(training_data=...)",)) as step:
        sampler = DistributedSampler(
            dataset, num_replicas=cfg.data_parallel_size, rank=rank, shuffle=not for_pipeline
        )
        step.did(
            f"{cfg.micro_batch_size} samples per batch, data-parallel rank {rank} of "
            f"{cfg.data_parallel_size}" + (", in order, repeating" if for_pipeline else "")
        )
        loader = DataLoader(
            dataset, batch_size=cfg.micro_batch_size, sampler=sampler, collate_fn=collate_fn
        )
        return pipeline.RepeatingLoader(loader) if for_pipeline else loader


def pipeline_executor(
    composition: Composition, module: pipeline.PipelineModule, opt: Any, cfg: EngineConfig
) -> pipeline.PipelineExecutor:
    """Step 8 (a pipeline): the executor of this rank's stage, its schedule from the `pipeline`
    section (collective over the grid: the executor's build agreement); with `torch_autocast`,
    each stage's forward runs in `zero.autocast_region` (the loss outside it, as DeepSpeed's)."""
    schedule = _schedule(module, cfg)
    autocast, region = cfg.precision.autocast, None
    if autocast is not None:  # each stage's forward under torch_autocast, as DeepSpeed's
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        region = functools.partial(zero.autocast_region, autocast, device.type)
    with composition.step("pipeline executor", keys=("pipeline",)) as step:
        executor = pipeline.PipelineExecutor(
            module,
            opt,
            micro_batches=cfg.gradient_accumulation_steps,
            schedule=schedule,
            forward_region=region,
        )
        lo, hi = module.boundaries[module.stage], module.boundaries[module.stage + 1]
        step.did(
            f"stage {module.stage} of {module.stages} (layers {lo}..{hi - 1}), schedule "
            f"{schedule}, {cfg.gradient_accumulation_steps} micro-batches per step"
        )
        return executor


def _schedule(module: pipeline.PipelineModule, cfg: EngineConfig) -> str:
    """The schedule the `pipeline` section asks for, as `EngineConfig` read it with the module's
    stage count (`PipelineConfig.from_section`: `schedule`, minispeed's key, else 1F1B, or GPipe
    when there are fewer micro-batches than stages; `stages` must be "auto" or the module's)."""
    assert cfg.pipeline is not None and cfg.pipeline.stages == module.stages
    return cfg.pipeline.schedule


def check_pipeline(module: pipeline.PipelineModule, cfg: EngineConfig, has_experts: bool) -> None:
    """What a pipeline does not compose with, refused before any collective of the engine."""
    if module.virtual_stages != 1:
        raise ValueError("a pipeline engine runs one chunk per stage (virtual_stages=1)")
    if cfg.zero.stage >= 3:
        raise NotImplementedError(
            f"zero_optimization.stage={cfg.zero.stage} with a pipeline: use stage 0, 1 or 2 "
            "(stage 3 gathers each layer's parameters around its forward and backward, per "
            "micro-batch in a pipeline; DeepSpeed refuses it with pipelines too)"
        )
    if has_experts:
        raise NotImplementedError(
            "a PipelineModule with MoE layers is not supported: the experts' groups are built "
            "over the world, not inside the grid's data axis; use one of them"
        )
