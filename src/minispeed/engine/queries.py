"""DeepSpeed engine's query methods that only read the config, the process group or the
optimizer's param groups, kept apart from the training loop (`engine.py`).

Scripts call them to log or to branch (`if engine.global_rank == 0`, `engine.fp16_enabled()`,
`engine.get_mom()`); each answers as DeepSpeed 0.19.8's engine does for the same config
(`scripts/record_ds_classic.py` records them). Costs: attribute reads, no collective.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import minispeed.comm as comm

__all__ = ["DeepSpeedQueries"]


class DeepSpeedQueries:
    """Mixed into `Engine`: expects `config` (an `EngineConfig`) and `optimizer`."""

    config: Any
    optimizer: Any

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (torchrun's `LOCAL_RANK`; 0 without a launcher)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        """This process's rank in the world."""
        return comm.get_rank()

    @property
    def world_size(self) -> int:
        """The number of processes in the world."""
        return comm.get_world_size()

    @property
    def dp_world_size(self) -> int:
        """The data-parallel size (ranks that split each batch)."""
        return self.config.data_parallel_size

    def fp16_enabled(self) -> bool:
        return self.config.precision.param_dtype == torch.float16

    def bfloat16_enabled(self) -> bool:
        return self.config.precision.param_dtype == torch.bfloat16

    def zero_optimization(self) -> bool:
        """Whether ZeRO partitions anything (stage > 0), DeepSpeed's `zero_enabled`."""
        return self.config.zero.stage > 0

    def gradient_clipping(self) -> float:
        """The global-norm clipping threshold (0.0: off; DeepSpeed's default 1.0 when absent)."""
        return self.config.zero.max_grad_norm

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether the config lets a ZeRO-3 model be gathered whole on saving
        (`stage3_gather_16bit_weights_on_model_save`)."""
        return bool(self.config.zero.stage3_gather_16bit_weights_on_model_save)

    def get_mom(self) -> list[Any]:
        """Each param group's `betas` (Adam-like) or `momentum` (SGD-like), as DeepSpeed's."""
        groups = [] if self.optimizer is None else self.optimizer.param_groups
        return [g["betas"] if "betas" in g else g.get("momentum") for g in groups]

    def save_fp16_model(self, save_dir: Any, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)  # type: ignore[attr-defined]

    # -- the config's settings, as DeepSpeed's engine reports them ------------------------------
    def steps_per_print(self) -> int | None:
        """How often the engine prints the step's line (None: never)."""
        return self.config.steps_per_print

    def get_batch_info(self) -> tuple[int, int, int]:
        """`(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`
        (DeepSpeed 0.19.8's returns the three bound methods instead of their values)."""
        c = self.config
        return c.train_batch_size, c.micro_batch_size, c.gradient_accumulation_steps

    def optimizer_params(self) -> dict[str, Any] | None:
        """The config's `optimizer.params` (None without an optimizer section)."""
        return None if self.config.optimizer is None else dict(self.config.optimizer.params)

    def scheduler_name(self) -> str | None:
        """The config's `scheduler.type` (None without a scheduler section)."""
        return None if self.config.scheduler is None else self.config.scheduler.type

    def scheduler_params(self) -> dict[str, Any] | None:
        """The config's `scheduler.params` (None without a scheduler section)."""
        return None if self.config.scheduler is None else dict(self.config.scheduler.params)

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """`(the parameters' dtype, the gradients' accumulation dtype)`."""
        return self.config.precision.param_dtype, self.config.precision.grad_accum_dtype

    def loss_scale(self) -> float:
        """The `fp16` section's static loss scale (0.0: dynamic), read whether or not fp16 is on."""
        return float(self.config.fp16.loss_scale)

    def dynamic_loss_scale(self) -> bool:
        """Whether fp16's loss scale is dynamic (`loss_scale` 0, the default)."""
        return self.loss_scale() == 0.0

    def initial_dynamic_scale(self) -> int:
        """The dynamic scale's start, `2 ** initial_scale_power`."""
        return 2**self.config.fp16.initial_scale_power

    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """The `fp16` section's dynamic-scale settings under DeepSpeed's argument names."""
        f = self.config.fp16
        return {
            "init_scale": 2**f.initial_scale_power,
            "scale_window": f.loss_scale_window,
            "delayed_shift": f.hysteresis,
            "consecutive_hysteresis": f.consecutive_hysteresis,
            "min_scale": f.min_loss_scale,
        }

    def flops_profiler_enabled(self) -> bool:
        return bool(self.config.flops_profiler.enabled)

    def zero_optimization_partition_gradients(self) -> bool:
        """Whether gradients are partitioned (stage 2 or 3)."""
        return self.config.zero.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Whether parameters are partitioned (stage 3)."""
        return self.config.zero.stage == 3

    def zero_offload_optimizer(self) -> Any:
        """The `offload_optimizer` section as read (minispeed.offload's), None when off."""
        return self.config.zero.offload_optimizer

    def zero_offload_param(self) -> Any:
        """The `offload_param` section as read (minispeed.offload's), None when off."""
        return self.config.zero.offload_param

    def _optimizer_device(self) -> str | None:
        where = self.config.zero.offload_optimizer
        return None if where is None else where.device

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer is offloaded to the CPU."""
        return self._optimizer_device() == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        """Whether the optimizer is offloaded to NVMe."""
        return self._optimizer_device() == "nvme"

    def zero_use_cpu_optimizer(self) -> bool:
        """Whether a CPU optimizer steps (the optimizer offloaded to CPU or NVMe)."""
        return self._optimizer_device() in ("cpu", "nvme")

    def zero_reduce_bucket_size(self) -> int:
        return self.config.zero.reduce_bucket_numel

    def zero_allgather_bucket_size(self) -> int:
        return self.config.zero.allgather_bucket_numel

    def zero_overlap_comm(self) -> bool:
        """minispeed's, which differs from DeepSpeed's default at stages 0-1 (Note
        [overlap_comm's default] in minispeed.zero.config)."""
        return self.config.zero.overlap_comm

    def zero_contiguous_gradients(self) -> bool:
        return self.config.zero.contiguous_gradients

    def zero_reduce_scatter(self) -> bool:
        return self.config.zero.reduce_scatter

    def zero_ignore_unused_parameters(self) -> bool:
        return self.config.zero.ignore_unused_parameters

    def zero_sub_group_size(self) -> int:
        return self.config.zero.sub_group_numel

    def zero_prefetch_bucket_size(self) -> int:
        return self.config.zero.stage3_prefetch_bucket_numel

    def zero_param_persistence_threshold(self) -> int:
        return self.config.zero.stage3_param_persistence_threshold_numel

    def zero_max_live_parameters(self) -> int:
        return self.config.zero.stage3_max_live_numel

    def zero_max_reuse_distance(self) -> int:
        return self.config.zero.stage3_max_reuse_distance_numel

    def zero_allow_untested_optimizer(self) -> bool:
        return self.config.zero_allow_untested_optimizer

    def zero_force_ds_cpu_optimizer(self) -> bool:
        return self.config.zero_force_ds_cpu_optimizer
