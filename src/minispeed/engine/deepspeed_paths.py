"""DeepSpeed's module paths and where each lands in minispeed: the one table of them.

```python
from minispeed.engine.deepspeed_paths import ADAPTERS, REFUSED, why
ADAPTERS["deepspeed.runtime.lr_schedules"]     # "minispeed.engine.runtime.lr_schedules"
REFUSED["deepspeed.autotuning"]                 # why not, and what to use instead
why("deepspeed.runtime.bf16_optimizer")        # "BF16_Optimizer; set `bf16: {enabled: true}` ..."
```

`ADAPTERS` maps each DeepSpeed module a script or library may import to the engine module that
answers for it: the same path under `minispeed.engine` wherever the name is free, `ds_<name>`
where the engine's own module holds DeepSpeed's name (`checkpoint`, `launcher`). `REFUSED` maps
the DeepSpeed modules minispeed does not provide to the reason and the replacement. Every other
public module of DeepSpeed 0.19.8 (tests/engine/fixtures/ds_modules.json, recorded by
scripts/record_ds_modules.py) is refused too (`refused_modules`), with the replacement `HINTS`
names for its longest listed prefix, or `DEFAULT_HINT` (`why`).

The `deepspeed` distribution (`packages/deepspeed_compat`) is generated from this table by
`scripts/sync_deepspeed_compat.py`: one module per entry, each adapter module re-exporting its
engine module's names (the same objects, nothing loaded twice) and each refused one raising
`ImportError` with the message below (`refuse`). tests/engine/test_compat_paths.py checks that
the distribution's tree is exactly what the table generates, that every path imports and
resolves as an attribute from `deepspeed`, and that each refusal names its replacement, for
every recorded public module of DeepSpeed.
Nothing in the engine imports this module.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType

from minispeed.engine.missing import NotProvided, decline

__all__ = [
    "ADAPTERS",
    "DEFAULT_HINT",
    "HINTS",
    "REFUSED",
    "adapted_attribute",
    "refuse",
    "refused_modules",
    "why",
]

_E = "minispeed.engine"

ADAPTERS: dict[str, str] = {
    "deepspeed": _E,
    "deepspeed.accelerator": f"{_E}.accelerator",
    "deepspeed.accelerator.abstract_accelerator": f"{_E}.accelerator",
    "deepspeed.accelerator.real_accelerator": f"{_E}.accelerator",
    "deepspeed.checkpoint": f"{_E}.ds_checkpoint",
    "deepspeed.checkpoint.utils": f"{_E}.ds_checkpoint",
    "deepspeed.checkpointing": f"{_E}.checkpointing",
    "deepspeed.comm": f"{_E}.comm",
    "deepspeed.compression": f"{_E}.compression",
    "deepspeed.compression.compress": f"{_E}.compression.compress",
    "deepspeed.compression.helper": f"{_E}.compression.helper",
    "deepspeed.compression.scheduler": f"{_E}.compression.scheduler",
    "deepspeed.comm.comm": f"{_E}.comm",
    "deepspeed.comm.reduce_op": f"{_E}.comm",
    "deepspeed.git_version_info": f"{_E}.git_version_info",
    "deepspeed.inference": f"{_E}.inference",
    "deepspeed.launcher": f"{_E}.ds_launcher",
    "deepspeed.launcher.runner": f"{_E}.ds_launcher",
    "deepspeed.moe": f"{_E}.moe",
    "deepspeed.moe.layer": f"{_E}.moe.layer",
    "deepspeed.moe.sharded_moe": f"{_E}.moe.sharded_moe",
    "deepspeed.moe.utils": f"{_E}.moe.utils",
    "deepspeed.monitor": f"{_E}.monitor",
    "deepspeed.monitor.comet": f"{_E}.monitor.comet",
    "deepspeed.monitor.config": f"{_E}.monitor.config",
    "deepspeed.monitor.csv_monitor": f"{_E}.monitor.csv_monitor",
    "deepspeed.monitor.monitor": f"{_E}.monitor.monitor",
    "deepspeed.monitor.tensorboard": f"{_E}.monitor.tensorboard",
    "deepspeed.monitor.utils": f"{_E}.monitor.utils",
    "deepspeed.monitor.wandb": f"{_E}.monitor.wandb",
    "deepspeed.ops": f"{_E}.ops",
    "deepspeed.ops.adagrad": f"{_E}.ops.adagrad",
    "deepspeed.ops.adagrad.cpu_adagrad": f"{_E}.ops.adagrad",
    "deepspeed.ops.adam": f"{_E}.ops.adam",
    "deepspeed.ops.adam.cpu_adam": f"{_E}.ops.adam",
    "deepspeed.ops.adam.fused_adam": f"{_E}.ops.adam",
    "deepspeed.ops.lion": f"{_E}.ops.lion",
    "deepspeed.ops.lion.cpu_lion": f"{_E}.ops.lion",
    "deepspeed.pipe": f"{_E}.pipe",
    "deepspeed.profiling": f"{_E}.profiling",
    "deepspeed.profiling.flops_profiler": f"{_E}.profiling.flops_profiler",
    "deepspeed.profiling.flops_profiler.profiler": f"{_E}.profiling.flops_profiler",
    "deepspeed.runtime": f"{_E}.runtime",
    "deepspeed.runtime.activation_checkpointing": f"{_E}.runtime.activation_checkpointing",
    "deepspeed.runtime.activation_checkpointing.checkpointing": (
        f"{_E}.runtime.activation_checkpointing.checkpointing"
    ),
    "deepspeed.runtime.base_optimizer": f"{_E}.runtime.base_optimizer",
    "deepspeed.runtime.config": f"{_E}.runtime.config",
    "deepspeed.runtime.data_pipeline": f"{_E}.runtime.data_pipeline",
    "deepspeed.runtime.data_pipeline.curriculum_scheduler": (
        f"{_E}.runtime.data_pipeline.curriculum_scheduler"
    ),
    "deepspeed.runtime.dataloader": f"{_E}.runtime.dataloader",
    "deepspeed.runtime.engine": f"{_E}.runtime.engine",
    "deepspeed.runtime.lr_schedules": f"{_E}.runtime.lr_schedules",
    "deepspeed.runtime.pipe": f"{_E}.runtime.pipe",
    "deepspeed.runtime.pipe.engine": f"{_E}.runtime.pipe.engine",
    "deepspeed.runtime.pipe.module": f"{_E}.runtime.pipe.module",
    "deepspeed.runtime.pipe.topology": f"{_E}.runtime.pipe.topology",
    "deepspeed.runtime.tensor_parallel": f"{_E}.runtime.tensor_parallel",
    "deepspeed.runtime.torch_autocast": f"{_E}.runtime.torch_autocast",
    "deepspeed.runtime.utils": f"{_E}.runtime.utils",
    "deepspeed.runtime.zero": f"{_E}.runtime.zero",
    "deepspeed.runtime.zero.config": f"{_E}.runtime.zero.config",
    "deepspeed.runtime.zero.offload_config": f"{_E}.runtime.zero.offload_config",
    "deepspeed.runtime.zero.partition_parameters": f"{_E}.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.parameter_offload": f"{_E}.runtime.zero.parameter_offload",
    "deepspeed.runtime.zero.stage3": f"{_E}.runtime.zero.stage3",
    "deepspeed.runtime.zero.stage_1_and_2": f"{_E}.runtime.zero.stage_1_and_2",
    "deepspeed.utils": f"{_E}.utils",
    "deepspeed.utils.groups": f"{_E}.utils.groups",
    "deepspeed.utils.init_on_device": f"{_E}.utils.init_on_device",
    "deepspeed.utils.logging": f"{_E}.utils.logging",
    "deepspeed.utils.tensor_fragment": f"{_E}.utils.tensor_fragment",
    "deepspeed.utils.z3_leaf_module": f"{_E}.utils.z3_leaf_module",
    "deepspeed.utils.zero_to_fp32": f"{_E}.utils.zero_to_fp32",
    "deepspeed.utils.zero_to_torch": f"{_E}.utils.zero_to_torch",
    "deepspeed.zero": f"{_E}.zero",
    "deepspeed.runtime.sequence_parallel": f"{_E}.runtime.sequence_parallel",
    "deepspeed.runtime.sequence_parallel.parallel_state_sp": (
        f"{_E}.runtime.sequence_parallel.parallel_state_sp"
    ),
    "deepspeed.runtime.sequence_parallel.ulysses_sp": (
        f"{_E}.runtime.sequence_parallel.ulysses_sp"
    ),
    "deepspeed.elasticity": f"{_E}.elasticity",  # DeepSpeed 0.17.6's (0.19.8 removed it)
    "deepspeed.sequence": f"{_E}.sequence",
    "deepspeed.sequence.layer": f"{_E}.sequence.layer",
}

_OFFLOAD = "minispeed.offload (CPUAdam, async I/O, the NVMe swapper; docs/packages/offload.md)"

REFUSED: dict[str, str] = {
    "deepspeed.autotuning": "DeepSpeed's autotuner; use `minispeed tune` (docs/cli/tune.md)",
    "deepspeed.compile": "DeepSpeed's compile backends; call torch.compile on your model",
    "deepspeed.env_report": "the `ds_report` environment report; run `minispeed report`",
    "deepspeed.io": f"DeepSpeed's file I/O engine; use {_OFFLOAD}",
    "deepspeed.linear": "LoRA-optimized linear layers; use your model's own (or peft's) layers",
    "deepspeed.model_implementations": (
        "DeepSpeed's inference model zoo; use init_inference on a Hugging Face or minispeed model"
    ),
    "deepspeed.module_inject": (
        "kernel injection by DeepSpeed's policies; use init_inference(model, "
        "replace_with_kernel_inject=True), which applies minispeed.inference's policies"
    ),
    "deepspeed.nvme": f"DeepSpeed's NVMe benchmarks; use {_OFFLOAD}",
    "deepspeed.ops.aio": f"DeepSpeed's async I/O op; use {_OFFLOAD}",
    "deepspeed.ops.lamb": (
        "FusedLamb (minispeed's ZeRO refuses LAMB: its trust ratio reads whole tensors); use "
        "deepspeed.ops.adam.FusedAdam, or torch's optimizers at ZeRO stage 0"
    ),
    "deepspeed.ops.op_builder": (
        "DeepSpeed's op builders; minispeed's are minispeed.core.op_builder, listed by "
        "`minispeed report`"
    ),
    "deepspeed.ops.sparse_attention": (
        "DeepSpeed's training sparse attention kernels; minispeed's block-sparse attention is "
        "for inference (minispeed.inference, docs/packages/inference.md)"
    ),
    "deepspeed.ops.transformer": (
        "DeepSpeedTransformerLayer (fused training kernels); use your model's layers, and "
        "init_inference (minispeed.inference) for fused inference kernels"
    ),
    "deepspeed.runtime.checkpoint_engine": (
        "pluggable checkpoint engines; use checkpoint.async_save in the config for background "
        "saves (docs/engine/checkpoints.md)"
    ),
    "deepspeed.runtime.fp16": (
        "DeepSpeed's fp16 optimizer wrappers; mixed precision is the config's fp16/bf16 section, "
        "and the loss scaler is minispeed.zero.LossScaler"
    ),
    "deepspeed.runtime.hybrid_engine": "the RLHF hybrid engine; train and generate with two engines",
    "deepspeed.runtime.progressive_layer_drop": (
        "progressive layer drop (gone from DeepSpeed 0.19.8 too); to drop layers, use a model "
        "whose forward skips them (docs/engine/migration.md)"
    ),
    "deepspeed.runtime.swap_tensor": f"DeepSpeed's swappers; use {_OFFLOAD}",
    "deepspeed.runtime.zero.tiling": (
        "TiledLinear; stage 3 gathers one module at a time already: use a ModuleList of smaller "
        "linears in place of a huge one"
    ),
    "deepspeed.runtime.zero.mics": (
        "MiCS_Init (gone from DeepSpeed 0.19.8 too); set zero_optimization.mics_shard_size in the "
        "config (docs/engine/config-reference.md)"
    ),
}

_INFERENCE = "init_inference(model, config) and minispeed.inference (docs/packages/inference.md)"
_ZERO = "deepspeed.zero / deepspeed.runtime.zero (minispeed.zero, docs/packages/zero-stage3.md)"

# What to use instead of DeepSpeed's other public modules (scripts/record_ds_modules.py lists
# them): the longest prefix of a path names its replacement, `DEFAULT_HINT` the rest.
HINTS: dict[str, str] = {
    "deepspeed.accelerator": (
        "DeepSpeed's accelerator back ends; use deepspeed.accelerator.get_accelerator(), which "
        "answers for the device torch runs on"
    ),
    "deepspeed.checkpoint": (
        "DeepSpeed's checkpoint reshaping and universal checkpoints; minispeed's checkpoints "
        "load at any world size, and `minispeed consolidate` writes one state dict "
        "(docs/engine/checkpoints.md)"
    ),
    "deepspeed.comm": "DeepSpeed's communication back ends; use deepspeed.comm (over torch.distributed)",
    "deepspeed.datastates": "DataStates checkpointing; use checkpoint.async_save in the config",
    "deepspeed.inference": f"DeepSpeed's inference engine internals; use {_INFERENCE}",
    "deepspeed.inference.v2": f"DeepSpeed-FastGen (inference v2); use {_INFERENCE}",
    "deepspeed.launcher": (
        "DeepSpeed's launcher internals; launch with `minispeed run` or torchrun "
        "(deepspeed.launcher.runner keeps DEEPSPEED_ENVIRONMENT_NAME)"
    ),
    "deepspeed.moe": "DeepSpeed's MoE internals; use deepspeed.moe.layer.MoE (minispeed.moe)",
    "deepspeed.ops": (
        "DeepSpeed's CUDA ops; minispeed's ops and their PyTorch references are listed by "
        "`minispeed report`"
    ),
    "deepspeed.ops.adam": "use deepspeed.ops.adam (FusedAdam, DeepSpeedCPUAdam)",
    "deepspeed.ops.lion": "use deepspeed.ops.lion (DeepSpeedCPULion)",
    "deepspeed.profiling": (
        "the flops profiler's config; use the `flops_profiler` config section, "
        "deepspeed.profiling.flops_profiler, or minispeed.profiler"
    ),
    "deepspeed.runtime.activation_checkpointing": (
        "use the `activation_checkpointing` config section and "
        "deepspeed.runtime.activation_checkpointing.checkpointing (deepspeed.checkpointing)"
    ),
    "deepspeed.runtime.bf16_optimizer": (
        "BF16_Optimizer; set `bf16: {enabled: true}` in the config (ZeRO keeps the fp32 masters)"
    ),
    "deepspeed.runtime.comm": "DeepSpeed's coalesced collectives; use deepspeed.comm",
    "deepspeed.runtime.constants": "DeepSpeed's config key names; use deepspeed.runtime.config",
    "deepspeed.runtime.compiler": "DeepSpeed's compile wrapper; call torch.compile on your model",
    "deepspeed.runtime.config_utils": "DeepSpeed's config models; use deepspeed.runtime.config",
    "deepspeed.runtime.data_pipeline": (
        "DeepSpeed's data-efficiency sampler and random-LTD; use your DataLoader to order or "
        "filter the data, with deepspeed.runtime.data_pipeline.curriculum_scheduler's "
        "CurriculumScheduler for the difficulty of each step (docs/engine/migration.md)"
    ),
    "deepspeed.runtime.model_checkpointing": (
        "DeepSpeed's checkpoint writers; use engine.save_checkpoint (docs/engine/checkpoints.md)"
    ),
    "deepspeed.runtime.pipe": (
        "DeepSpeed's pipeline schedules and p2p; use deepspeed.runtime.pipe.engine and "
        "minispeed.pipeline's schedules (docs/packages/pipeline.md)"
    ),
    "deepspeed.runtime.precision_config": "use the config's fp16 / bf16 sections",
    "deepspeed.runtime.state_dict_factory": (
        "DeepSpeed's Megatron checkpoint loaders; use engine.load_checkpoint"
    ),
    "deepspeed.runtime.superoffload": f"SuperOffload; use offload_optimizer: cpu, {_OFFLOAD}",
    "deepspeed.runtime.tensor_parallel": (
        "DeepSpeed's AutoTP internals; use minispeed.tensor_parallel "
        "(docs/packages/tensor_parallel.md)"
    ),
    "deepspeed.runtime.zenflow": f"ZenFlow; use offload_optimizer: cpu, {_OFFLOAD}",
    "deepspeed.runtime.zero": f"ZeRO's internals; use {_ZERO}",
    "deepspeed.sequence": (
        "DeepSpeed's AutoSP, FPDT and vocabulary-parallel losses; use "
        "deepspeed.sequence.layer.DistributedAttention (minispeed.tensor_parallel.ulysses)"
    ),
    "deepspeed.utils": "DeepSpeed's utilities; use deepspeed.utils (minispeed.engine.utils)",
    "deepspeed.utils.comms_logging": "use the `comms_logger` config section",
    "deepspeed.utils.timer": (
        "DeepSpeed's timers; set `wall_clock_breakdown: true` in the config (the engine reports "
        "forward, backward and step times)"
    ),
}

DEFAULT_HINT = (
    "DeepSpeed's own machinery, with no counterpart in minispeed; see docs/engine/migration.md "
    "for what to use"
)


def why(path: str) -> str:
    """Why `path` is not provided and what to use instead: its `REFUSED` entry, else the hint
    of its longest prefix in `HINTS`, else `DEFAULT_HINT`."""
    if path in REFUSED:
        return REFUSED[path]
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in HINTS:
            return HINTS[".".join(parts[:end])]
    return DEFAULT_HINT


def refused_modules(public: Iterable[str]) -> list[str]:
    """The modules the distribution refuses: `REFUSED`, and for each of DeepSpeed's `public`
    paths that no adapter answers, its first component that is not an adapter (one module
    refuses itself and everything below it: importing `deepspeed.compile.backend` runs
    `deepspeed.compile` first, whose error names it)."""
    out = set(REFUSED)
    for path in public:
        parts = path.split(".")
        prefixes = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
        first = next((p for p in prefixes if p not in ADAPTERS), None)
        if first is not None and not any(p in REFUSED for p in prefixes):
            out.add(first)
    return sorted(out)


def refuse(path: str, package: bool = False) -> None:
    """Raise the `ImportError` of a refused DeepSpeed module (the distribution's refused modules
    call this when imported). For a DeepSpeed `package` it names the modules below it too: they
    cannot import without it, so this is their error as well."""
    below = " (nor is any module below it)" if package else ""
    raise ImportError(f"{path} is not provided by minispeed{below}: {why(path)}", name=path)


def adapted_attribute(path: str, target: ModuleType, name: str) -> object:
    """An adapter module's `__getattr__` (the distribution's modules call it): `name` from the
    engine module `target` (a private name a client reaches for is the engine's same object);
    a name neither has raises naming the DeepSpeed module `path`, the name and the migration
    page, as an ImportError under `from path import name` and an AttributeError otherwise
    (`minispeed.engine.missing`); a name the engine module declines keeps its own message."""
    try:
        return getattr(target, name)
    except NotProvided as declined:  # the engine module declines it, saying why
        message = str(declined)
    except AttributeError:
        if name.startswith("__"):  # Python's own probes (`__path__`, `__wrapped__`): no message
            raise
        message = (
            f"{path}.{name} is not provided by minispeed ({path} is minispeed's "
            f"{target.__name__}, which has no {name!r}); see docs/engine/migration.md for what "
            "to use instead"
        )
    decline(message, name, depth=2)  # 1: the adapter's __getattr__, 2: the code asking
