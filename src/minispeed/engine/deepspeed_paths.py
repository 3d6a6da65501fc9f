"""DeepSpeed's module paths and where each lands in minispeed: the one table of them.

```python
from minispeed.engine.deepspeed_paths import ADAPTERS, REFUSED
ADAPTERS["deepspeed.runtime.lr_schedules"]     # "minispeed.engine.runtime.lr_schedules"
REFUSED["deepspeed.autotuning"]                 # why not, and what to use instead
```

`ADAPTERS` maps each DeepSpeed module a script or library may import to the engine module that
answers for it: the same path under `minispeed.engine` wherever the name is free, `ds_<name>`
where the engine's own module holds DeepSpeed's name (`checkpoint`, `launcher`). `REFUSED` maps
the DeepSpeed modules minispeed does not provide to the reason and the replacement.

The `deepspeed` distribution (`packages/deepspeed_compat`) is generated from this table by
`scripts/sync_deepspeed_compat.py`: one module per entry, each adapter module re-exporting its
engine module's names (the same objects, nothing loaded twice) and each refused one raising
`ImportError` with the message below (`refuse`). tests/engine/test_compat_paths.py checks that
the distribution's tree is exactly what the table generates, that every path imports and
resolves as an attribute from `deepspeed`, and that each refusal names its replacement.
Nothing in the engine imports this module.
"""

from __future__ import annotations

__all__ = ["ADAPTERS", "REFUSED", "refuse"]

_E = "minispeed.engine"

ADAPTERS: dict[str, str] = {
    "deepspeed": _E,
    "deepspeed.accelerator": f"{_E}.accelerator",
    "deepspeed.checkpoint": f"{_E}.ds_checkpoint",
    "deepspeed.checkpoint.utils": f"{_E}.ds_checkpoint",
    "deepspeed.checkpointing": f"{_E}.checkpointing",
    "deepspeed.comm": f"{_E}.comm",
    "deepspeed.git_version_info": f"{_E}.git_version_info",
    "deepspeed.inference": f"{_E}.inference",
    "deepspeed.launcher": f"{_E}.ds_launcher",
    "deepspeed.launcher.runner": f"{_E}.ds_launcher",
    "deepspeed.moe": f"{_E}.moe",
    "deepspeed.moe.layer": f"{_E}.moe.layer",
    "deepspeed.moe.sharded_moe": f"{_E}.moe.sharded_moe",
    "deepspeed.moe.utils": f"{_E}.moe.utils",
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
    "deepspeed.runtime": f"{_E}.runtime",
    "deepspeed.runtime.activation_checkpointing": f"{_E}.runtime.activation_checkpointing",
    "deepspeed.runtime.activation_checkpointing.checkpointing": (
        f"{_E}.runtime.activation_checkpointing.checkpointing"
    ),
    "deepspeed.runtime.config": f"{_E}.runtime.config",
    "deepspeed.runtime.dataloader": f"{_E}.runtime.dataloader",
    "deepspeed.runtime.engine": f"{_E}.runtime.engine",
    "deepspeed.runtime.lr_schedules": f"{_E}.runtime.lr_schedules",
    "deepspeed.runtime.pipe": f"{_E}.runtime.pipe",
    "deepspeed.runtime.pipe.engine": f"{_E}.runtime.pipe.engine",
    "deepspeed.runtime.pipe.module": f"{_E}.runtime.pipe.module",
    "deepspeed.runtime.pipe.topology": f"{_E}.runtime.pipe.topology",
    "deepspeed.runtime.tensor_parallel": f"{_E}.runtime.tensor_parallel",
    "deepspeed.runtime.utils": f"{_E}.runtime.utils",
    "deepspeed.runtime.zero": f"{_E}.runtime.zero",
    "deepspeed.runtime.zero.config": f"{_E}.runtime.zero.config",
    "deepspeed.runtime.zero.offload_config": f"{_E}.runtime.zero.offload_config",
    "deepspeed.runtime.zero.partition_parameters": f"{_E}.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.stage3": f"{_E}.runtime.zero.stage3",
    "deepspeed.runtime.zero.stage_1_and_2": f"{_E}.runtime.zero.stage_1_and_2",
    "deepspeed.utils": f"{_E}.utils",
    "deepspeed.utils.groups": f"{_E}.utils.groups",
    "deepspeed.utils.init_on_device": f"{_E}.utils.init_on_device",
    "deepspeed.utils.tensor_fragment": f"{_E}.utils.tensor_fragment",
    "deepspeed.utils.z3_leaf_module": f"{_E}.utils.z3_leaf_module",
    "deepspeed.utils.zero_to_fp32": f"{_E}.utils.zero_to_fp32",
    "deepspeed.zero": f"{_E}.zero",
}

_OFFLOAD = "minispeed.offload (CPUAdam, async I/O, the NVMe swapper; docs/packages/offload.md)"

REFUSED: dict[str, str] = {
    "deepspeed.autotuning": "DeepSpeed's autotuner; use `minispeed tune` (docs/cli/tune.md)",
    "deepspeed.compile": "DeepSpeed's compile backends; call torch.compile on your model",
    "deepspeed.compression": (
        "model compression (quantization-aware training, pruning, distillation); for int8 "
        "inference use init_inference(model, dtype=torch.int8) (docs/packages/inference.md)"
    ),
    "deepspeed.elasticity": "elastic training; launch a fixed world with `minispeed run` or torchrun",
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
    "deepspeed.monitor": (
        "DeepSpeed's TensorBoard/W&B/CSV monitors; use your own logging of engine.get_lr() and "
        "the loss, or the config's comms_logger / flops_profiler"
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
        "init_inference for fused inference kernels"
    ),
    "deepspeed.runtime.checkpoint_engine": (
        "pluggable checkpoint engines; use checkpoint.async_save in the config for background "
        "saves (docs/engine/checkpoints.md)"
    ),
    "deepspeed.runtime.data_pipeline": "curriculum learning and data efficiency; feed your own loader",
    "deepspeed.runtime.fp16": (
        "DeepSpeed's fp16 optimizer wrappers; mixed precision is the config's fp16/bf16 section, "
        "and the loss scaler is minispeed.zero.LossScaler"
    ),
    "deepspeed.runtime.hybrid_engine": "the RLHF hybrid engine; train and generate with two engines",
    "deepspeed.runtime.sequence_parallel": (
        "DeepSpeed-Ulysses sequence parallelism; train without sp_size > 1"
    ),
    "deepspeed.runtime.swap_tensor": f"DeepSpeed's swappers; use {_OFFLOAD}",
    "deepspeed.runtime.zero.tiling": (
        "TiledLinear; stage 3 gathers one module at a time already: use a ModuleList of smaller "
        "linears in place of a huge one"
    ),
    "deepspeed.sequence": "DeepSpeed-Ulysses sequence parallelism; train without sp_size > 1",
}


def refuse(path: str) -> None:
    """Raise the `ImportError` of a refused DeepSpeed module (the distribution's refused modules
    call this when imported)."""
    raise ImportError(f"{path} is not provided by minispeed: {REFUSED[path]}", name=path)
