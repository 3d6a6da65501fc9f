"""DeepSpeed engine's query methods that only read the config, the process group or the
optimizer's param groups, kept apart from the training loop (`engine.py`).

Scripts call them to log or to branch (`if engine.global_rank == 0`, `engine.fp16_enabled()`,
`engine.get_mom()`); each answers as DeepSpeed 0.19.8's engine does for the same config
(`scripts/record_ds_classic.py`, `record_ds_engine_queries.py` and `record_ds_engine_names.py`
record them). Costs: attribute reads, no collective.

An accessor of a DeepSpeed key minispeed does not implement answers the one value its section
accepts for it (the key's `ds_only` entry, DeepSpeed's default: `_accepted`), which is what the
parsed config holds there; the section's `ds_unsupported` table is the one place that value is
written.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import minispeed.comm as comm
import minispeed.engine.checkpoint.background as ckpt_async
import minispeed.engine.sequence_groups as sequence_groups
from minispeed.core.sections import unsupported_keys
from minispeed.engine.by_name import OptimizerSection
from minispeed.engine.checkpoint.grid import CheckpointConfig
from minispeed.engine.config import EngineConfig
from minispeed.offload.config import OffloadOptimizerConfig
from minispeed.profiler.config import FlopsProfilerConfig
from minispeed.zero import Autocast, Bf16Config, Fp16Config, TorchAutocastConfig, ZeroConfig

__all__ = ["DeepSpeedQueries"]


def _accepted(section: type, key: str) -> Any:
    """The one value `section` accepts for DeepSpeed's `key`, which it does not implement (its
    `ds_only` entry: DeepSpeed's default, where the key changes nothing)."""
    return unsupported_keys(section)[key].accepted


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

    # -- DeepSpeed's other accessors (tests/engine/test_engine_ds_names.py) ---------------------
    def optimizer_name(self) -> str | None:
        """The config's `optimizer.type` in lower case (DeepSpeed's spelling), else the class name
        of the optimizer given to `initialize` (None without either)."""
        if self.config.optimizer is not None:
            return self.config.optimizer.type.lower()
        inner = getattr(self.optimizer, "optimizer", self.optimizer)
        return None if inner is None else type(inner).__name__

    def optimizer_legacy_fusion(self) -> bool:
        return _accepted(OptimizerSection, "legacy_fusion")

    def get_type(self) -> list[Any]:
        """Each param group's `"type"` entry (0.0 where it has none), as DeepSpeed's."""
        groups = [] if self.optimizer is None else self.optimizer.param_groups
        return [g.get("type", 0.0) for g in groups]

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: `data_types.grad_accum_dtype` (fp32 unless asked;
        `communication_data_type` may only repeat it). DeepSpeed's default follows the model's
        16-bit dtype instead, so with `bf16` on and no `data_types` this says float32 where
        DeepSpeed says bfloat16: minispeed reduces in float32 there."""
        return self.config.precision.grad_accum_dtype

    @property
    def is_compiled(self) -> bool:
        """Whether `engine.compile()` compiled the model."""
        return getattr(self, "_compiled", False)

    # The ranks, from the engine's grid (`checkpoint.background.place_of`: data x pipe x tensor).
    def get_data_parallel_rank(self) -> int:
        """This rank's index among the replicas that split each batch. (DeepSpeed 0.19.8's asserts
        unless a Megatron `mpu` was passed to `initialize`.)"""
        return ckpt_async.place_of(self).data_rank

    def get_tensor_parallel_rank(self) -> int:
        """This rank's index on the tensor axis (0 without tensor parallelism)."""
        return ckpt_async.place_of(self).tensor_rank

    def get_model_parallel_rank(self) -> int:
        """This rank's index among the pipeline x tensor ranks of its replica (`stage x T +
        tensor rank`; 0 without either), the `mp_rank` of DeepSpeed's checkpoint file names."""
        place = ckpt_async.place_of(self)
        return place.stage * place.tensor + place.tensor_rank

    def get_sequence_parallel_group(self) -> Any:
        """The group of the S ranks splitting this rank's sequences (`sequence_parallel_size`)."""
        groups = sequence_groups.current()
        if self.config.sequence_parallel_size in (None, 1) or groups is None:
            raise RuntimeError(
                "engine.get_sequence_parallel_group(): no sequence parallelism in this engine "
                "(sequence_parallel_size is 1; DeepSpeed raises too); set sequence_parallel_size"
            )
        return groups.sequence_group

    # Settings minispeed reads from its sections.
    def autotp_size(self) -> int:
        return self.config.tensor_parallel.autotp_size

    def tensor_parallel_config(self) -> Any:
        """The `tensor_parallel` section as read (minispeed.tensor_parallel's)."""
        return self.config.tensor_parallel

    def aio_config(self) -> Any:
        """The `aio` section as read (minispeed.offload's `AioConfig`)."""
        return self.config.aio

    def flops_profiler_profile_step(self) -> int:
        return self.config.flops_profiler.profile_step

    def flops_profiler_module_depth(self) -> int:
        return self.config.flops_profiler.module_depth

    def flops_profiler_top_modules(self) -> int:
        return self.config.flops_profiler.top_modules

    def flops_profiler_detailed(self) -> bool:
        return self.config.flops_profiler.detailed

    def flops_profiler_output_file(self) -> str | None:
        return self.config.flops_profiler.output_file

    def checkpoint_tag_validation_enabled(self) -> bool:
        return self.config.checkpoint.tag_validation.upper() != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return self.config.checkpoint.tag_validation.upper() == "FAIL"

    def use_node_local_storage(self) -> bool:
        return self.config.checkpoint.use_node_local_storage

    def is_first_weights_partition_group(self) -> bool:
        """Whether parameters are partitioned (stage 3), as DeepSpeed's."""
        return self.config.zero.stage == 3

    def zero_hpz_partition_size(self) -> int:
        return self.config.zero.hpz_partition_size

    def zero_quantized_weights(self) -> bool:
        return self.config.zero.quantized_weights

    def zero_quantized_gradients(self) -> bool:
        return self.config.zero.quantized_gradients

    # Keys minispeed accepts at DeepSpeed's default only: that value.
    def flops_profiler_recompute_fwd_factor(self) -> float:
        return _accepted(FlopsProfilerConfig, "recompute_fwd_factor")

    def checkpoint_serialization_enabled(self) -> bool:
        return _accepted(CheckpointConfig, "checkpoint_serialization")

    def checkpoint_writer_enabled(self) -> bool:
        return _accepted(CheckpointConfig, "writer") is not None

    def load_universal_checkpoint(self) -> bool:
        return self.config.checkpoint.load_universal

    def fp16_auto_cast(self) -> bool:
        return self.config.fp16.enabled and self.config.fp16.auto_cast

    def fp16_master_weights_and_gradients(self) -> bool:
        return _accepted(Fp16Config, "fp16_master_weights_and_grads")

    def bf16_master_weights_and_gradients(self) -> bool:
        return _accepted(Bf16Config, "bf16_master_weights_and_grads")

    def bf16_optimizer_states(self) -> bool:
        return _accepted(Bf16Config, "bf16_optimizer_states")

    def zero_partial_offload(self) -> float:
        return _accepted(OffloadOptimizerConfig, "ratio")

    def super_offload(self) -> bool:
        return _accepted(OffloadOptimizerConfig, "super_offload")

    def cpuadam_cores_perc(self) -> float:
        """The section's value with the optimizer offloaded; DeepSpeed's engine answers 0.9
        without (its own fallback, not the section's default of 0.8)."""
        if self.config.zero.offload_optimizer is None:
            return 0.9
        return _accepted(OffloadOptimizerConfig, "cpuadam_cores_perc")

    def dataloader_drop_last(self) -> bool:
        return _accepted(EngineConfig, "dataloader_drop_last")

    def dump_state(self) -> bool:
        return _accepted(EngineConfig, "dump_state")

    def memory_breakdown(self) -> bool:
        return _accepted(EngineConfig, "memory_breakdown")

    def log_level(self) -> Any:
        return _accepted(EngineConfig, "log_level")

    def managed_gradient_accumulation(self) -> bool:
        return _accepted(EngineConfig, "managed_gradient_accumulation")

    def gradient_predivide_factor(self) -> float:
        return _accepted(EngineConfig, "gradient_predivide_factor")

    def postscale_gradients(self) -> bool:
        """Whether gradients are averaged after their reduction (`not prescale_gradients`)."""
        return not _accepted(EngineConfig, "prescale_gradients")

    def zenflow_config(self) -> Any:
        return _accepted(ZeroConfig, "zenflow")

    def zero_allgather_partitions(self) -> bool:
        return _accepted(ZeroConfig, "allgather_partitions")

    def zero_allgather_sequential(self) -> bool:
        return _accepted(ZeroConfig, "allgather_sequential")

    def zero_compute_grad_norm(self) -> bool:
        return _accepted(ZeroConfig, "compute_grad_norm")

    def zero_elastic_checkpoint(self) -> bool:
        return _accepted(ZeroConfig, "elastic_checkpoint")

    def zero_legacy_stage1(self) -> bool:
        return _accepted(ZeroConfig, "legacy_stage1")

    def zero_load_from_fp32_weights(self) -> bool:
        return _accepted(ZeroConfig, "load_from_fp32_weights")

    def zero_log_trace_cache_warnings(self) -> bool:
        return _accepted(ZeroConfig, "log_trace_cache_warnings")

    def zero_model_persistence_threshold(self) -> int:
        return _accepted(ZeroConfig, "model_persistence_threshold")

    def zero_module_granularity_threshold(self) -> int:
        return _accepted(ZeroConfig, "module_granularity_threshold")

    def zero_multi_rank_bucket_allreduce(self) -> bool:
        return _accepted(ZeroConfig, "use_multi_rank_bucket_allreduce")

    def zero_parameter_alignment(self) -> bool:
        return _accepted(ZeroConfig, "parameter_alignment")

    def zero_quantized_nontrainable_weights(self) -> bool:
        return _accepted(ZeroConfig, "zero_quantized_nontrainable_weights")

    def zero_round_robin_gradients(self) -> bool:
        return _accepted(ZeroConfig, "round_robin_gradients")

    def zero_save_muon_momentum_buffer_in_memory(self) -> bool:
        return _accepted(ZeroConfig, "save_muon_momentum_buffer_in_memory")

    def is_sanity_checks_enabled(self) -> bool:
        return _accepted(ZeroConfig, "enable_sanity_checks")

    # The switches of DeepSpeed features minispeed has not (accepted off only): False.
    def autotuning_enabled(self) -> bool:
        return _accepted(EngineConfig, "autotuning")["enabled"]

    def curriculum_learning_enabled(self) -> bool:
        """The data-efficiency sampler's curriculum (DeepSpeed's meaning of this query, not the
        legacy top-level `curriculum_learning` section): off, as `data_efficiency`."""
        return self.data_efficiency_enabled()

    def data_efficiency_enabled(self) -> bool:
        return _accepted(EngineConfig, "data_efficiency")["enabled"]

    def data_sampling_enabled(self) -> bool:
        """DeepSpeed's data-efficiency sampling: off (no `data_efficiency` library here)."""
        return self.data_efficiency_enabled()

    def random_ltd_enabled(self) -> bool:
        """DeepSpeed's random layer-token drop (a `data_efficiency` part): off."""
        return self.data_efficiency_enabled()

    def torch_autocast_enabled(self) -> bool:
        """`torch_autocast.enabled` (minispeed.zero.Autocast)."""
        return self.config.torch_autocast.enabled

    def torch_autocast_dtype(self) -> torch.dtype | None:
        """`torch_autocast.dtype` as a torch dtype, enabled or not; None where left out."""
        dtype = self.config.torch_autocast.dtype
        return None if dtype is None else TorchAutocastConfig.torch_dtype(dtype)

    def torch_autocast_lower_precision_safe_modules(self) -> list[str]:
        """The classes whose gradients travel in the autocast dtype, as the config names them
        (left out: DeepSpeed's defaults, `torch.nn.modules.linear.Linear` and the Convs)."""
        names = self.config.torch_autocast.lower_precision_safe_modules
        return list(names) if names is not None else Autocast().safe_module_names()
