"""The rest of DeepSpeed's engine surface: what changes the batch, the module's state dict, the
timers, and the names minispeed declines.

Every public name of DeepSpeed 0.19.8's `DeepSpeedEngine` (and `PipelineEngine`) answers on
minispeed's engine (`tests/engine/test_engine_ds_names.py` walks them): with DeepSpeed's
meaning (the loop in `engine.py`, the accessors in `queries.py`, the calls below), or declined
by name: `engine.allreduce_bucket` raises `NotProvided` (an `AttributeError`, so `hasattr`
answers False) whose message says what to use instead. Declined are DeepSpeed's own machinery
(its reduction helpers, autotuner, deepcompile, data-efficiency library), which minispeed does
in its packages or not at all. The table is `DECLINED`; `__getattr__` reads it only for a name
the engine does not have (a dict lookup before `nn.Module`'s own).

`set_train_batch_size` / `set_train_micro_batch_size` behave as DeepSpeed's: the micro-batch
(respectively the accumulation steps) stays, the other changes, at any micro-step; the next
window ends when the count of micro-steps is a multiple of the new accumulation steps
(`Engine.is_gradient_accumulation_boundary`, which `Engine.backward` tells the optimizer), and
every later loss is divided by them. Costs: none beyond replacing the config.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

import minispeed.zero as zero
from minispeed.engine.missing import NotProvided

__all__ = ["DECLINED", "PIPE_DECLINED", "DeepSpeedSurface"]

_REDUCTION = (
    "DeepSpeed's own gradient-reduction helper: minispeed's ZeRO optimizer reduces the gradients "
    "inside engine.backward() / engine.step() (minispeed.zero); for a collective of your own use "
    "deepspeed.comm (minispeed.engine.comm)"
)
_AUTOTUNING = "DeepSpeed's autotuner is not provided (its switch, autotuning_enabled(), is False); run `minispeed tune`"
_DEEPCOMPILE = (
    "DeepSpeed's deepcompile (compiler passes over the engine) is not provided: engine.compile() "
    "compiles the model with torch.compile at every ZeRO stage, without those passes"
)
_DATA_EFFICIENCY = (
    "DeepSpeed's data-efficiency library (curriculum learning, data sampling, random-LTD) is not "
    "provided; its switches answer False (engine.data_efficiency_enabled()): order or filter the "
    "data in your DataLoader"
)

# DeepSpeedEngine's public names minispeed's engine declines: name -> why, and what to use.
# fmt: off
DECLINED: Mapping[str, str] = {
    **dict.fromkeys(
        (
            "all_gather_scalar", "allreduce_and_copy", "allreduce_bucket", "allreduce_gradients",
            "allreduce_no_retain", "buffered_allreduce_fallback", "sparse_all_gather",
            "sparse_allreduce", "sparse_allreduce_bucket", "sparse_allreduce_no_retain",
        ),
        _REDUCTION,
    ),
    "clip_fp32_gradients": (
        "DeepSpeed's clipping helper: set gradient_clipping in the config; the optimizer clips "
        "at each step (engine.get_global_grad_norm() gives the norm)"
    ),
    "coalesce_grad_reduction": (
        "DeepSpeed's context that joins the reductions of several backward calls: call "
        "engine.backward() per micro-batch; the optimizer reduces once per accumulation window "
        "(stages 0-1) or per bucket (stages 2-3)"
    ),
    **dict.fromkeys(
        (
            "autotuning_end_profile_step", "autotuning_metric", "autotuning_metric_path",
            "autotuning_model_info_path", "autotuning_profile_model_info",
            "autotuning_start_profile_step",
        ),
        _AUTOTUNING,
    ),
    **dict.fromkeys(
        (
            "compile_autosp", "compile_autotp", "compile_zero_optimization_stage",
            "get_autosp_backend", "get_autotp_backend", "get_compile_time",
            "get_deepcompile_backend", "get_deepspeed_compile_backend", "is_deepcompile_active",
            "is_deepcompile_enabled", "register_compile_pass", "uses_parallelization_pass_only",
        ),
        _DEEPCOMPILE,
    ),
    **dict.fromkeys(
        (
            "curriculum_learning_config", "data_efficiency_config", "data_sampling_config",
            "random_ltd_config", "random_ltd_initialize", "set_data_post_process_func",
        ),
        _DATA_EFFICIENCY,
    ),
    "set_custom_curriculum_learning_schedule": (
        "DeepSpeed 0.19.8 hands it to its data-efficiency sampler only, which minispeed does not "
        "provide: give the function to your CurriculumScheduler's set_custom_get_difficulty "
        "(deepspeed.runtime.data_pipeline.curriculum_scheduler; docs/engine/migration.md)"
    ),
    "deepspeed_io": (
        "pass training_data= (and collate_fn=) to initialize(), which builds DeepSpeed's loader "
        "(engine.training_dataloader), or build a DataLoader with a DistributedSampler"
    ),
    "get_optimizer_configuration": (
        "DeepSpeed's mapping of the optimizer section to its fused kernels: the optimizer section "
        "is built by minispeed.engine.optim (engine.optimizer_name(), engine.optimizer_params())"
    ),
    "load_moe_state_dict": (
        "DeepSpeed's reader of its own expert checkpoint files: engine.load_checkpoint() restores "
        "the experts from minispeed's layout"
    ),
    "print_forward_breakdown": (
        "DeepSpeed's MoE timing print: wall_clock_breakdown prints the forward time with each "
        "steps_per_print line, and engine.get_wall_clock_timers() returns it"
    ),
    "scale": (
        "a manual loss.backward() after engine.scale(loss) is not supported: minispeed's ZeRO "
        "hooks count each micro-step through engine.backward(loss), which scales the loss"
    ),
    "swap_tensor_config": (
        "DeepSpeed 0.19.8's own raises AttributeError (its config has no swap_tensor_config); "
        "the swap settings are zero_optimization.offload_optimizer / offload_param "
        "(engine.zero_offload_optimizer(), engine.zero_offload_param())"
    ),
}
# fmt: on

# PipelineEngine's further public names minispeed's pipeline engine declines.
PIPE_DECLINED: Mapping[str, str] = {
    **DECLINED,
    **dict.fromkeys(
        ("DTYPE_TO_ID", "ID_TO_DTYPE"),
        "DeepSpeed's pipeline sends dtypes between stages as ids; minispeed's executor agrees on "
        "the activations' shapes and dtypes when it is built (minispeed.pipeline)",
    ),
    "get_additional_losses": (
        "DeepSpeed's auxiliary (MoE) losses of a pipeline are not provided: MoE layers are "
        "refused in minispeed's pipelines"
    ),
    **dict.fromkeys(
        ("log_for_device", "tput_log"),
        "DeepSpeed's pipeline debug logging: steps_per_print prints each step's loss, samples/s "
        "and timers",
    ),
    "set_has_attention_mask": (
        "DeepSpeed's flag for Megatron-style (inputs, mask) tuples: the first stage passes "
        "whatever the data iterator yields to the first layer; shape it with set_batch_fn"
    ),
}


class DeepSpeedSurface:
    """Mixed into `Engine` (before `nn.Module`): expects `config`, `optimizer`, `module`,
    `timers` and `dp_world_size`."""

    config: Any
    optimizer: Any
    module: Any
    timers: dict[str, float]
    dp_world_size: int
    _declined: ClassVar[Mapping[str, str]] = DECLINED

    def __getattr__(self, name: str) -> Any:
        """A name the engine does not have: declined by name (`DECLINED`), else `nn.Module`'s
        own lookup (parameters, buffers, submodules)."""
        if name in self._declined:  # no call: `self.module` is looked up here on every forward
            raise NotProvided(
                f"engine.{name} is not provided by minispeed: {self._declined[name]}",
                name=name,
                obj=self,
            )
        return nn.Module.__getattr__(self, name)  # type: ignore[arg-type]

    # -- the batch ------------------------------------------------------------------------------
    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the accumulation steps (the micro-batch stays):
        `gradient_accumulation_steps = train_batch_size / (micro-batch x data-parallel size)`.
        A size it does not divide is DeepSpeed's `ValueError`."""
        micro, n = self.config.micro_batch_size, self.dp_world_size
        if _count(train_batch_size) is None or train_batch_size % (micro * n):
            raise ValueError(
                "Train batch size must be divisible by micro-batch data parallelism: "
                f"set_train_batch_size({train_batch_size!r}) with micro-batch {micro} and "
                f"data-parallel size {n}; give a positive multiple of {micro * n}"
            )
        self._resize(train_batch_size, micro, train_batch_size // (micro * n))

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch, keeping the accumulation steps; the global batch follows
        (`micro_batch_size x gradient_accumulation_steps x data-parallel size`). The data loader
        `initialize` built keeps its batch size, as DeepSpeed's."""
        if _count(micro_batch_size) is None:
            raise ValueError(
                f"set_train_micro_batch_size({micro_batch_size!r}): give a positive int"
            )
        gas = self.config.gradient_accumulation_steps
        self._resize(micro_batch_size * gas * self.dp_world_size, micro_batch_size, gas)

    def _resize(self, train: int, micro: int, gas: int) -> None:
        c = self.config
        zero = dataclasses.replace(c.zero, gradient_accumulation_steps=gas)
        self.config = dataclasses.replace(
            c, train_batch_size=train, micro_batch_size=micro, gradient_accumulation_steps=gas,
            zero=zero,
        )  # fmt: skip
        opt = self.optimizer
        if opt is not None:  # later losses divided by `gas` (the optimizer reads its config's)
            opt.config = dataclasses.replace(opt.config, gradient_accumulation_steps=gas)

    # -- the module's state ---------------------------------------------------------------------
    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The model's `state_dict` (keys without the engine's `module.`), without the frozen
        parameters when asked, as DeepSpeed's. At ZeRO-3 the released parameters are
        placeholders (docs: "Differences that show"); `save_16bit_model` gathers them."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def load_module_state_dict(
        self,
        checkpoint: Mapping[str, Any],
        strict: bool = True,
        custom_load_fn: Callable[..., Any] | None = None,
        fetch_z3_params: bool = False,
        z3_params_to_fetch: Any = None,
        allowed_missing_keys: Any = None,
    ) -> None:
        """Load `checkpoint["module"]` into the model (`custom_load_fn(src=, dst=)` instead when
        given), as DeepSpeed's; `allowed_missing_keys` lets those keys be missing from a strict
        load. At ZeRO-3 the parameters to fetch (`fetch_z3_params=True`: all) are gathered
        around the load and their partitions rewritten from rank 0's values."""
        params: list[Any] = []
        if z3_params_to_fetch is not None:
            params = list(z3_params_to_fetch)
        elif fetch_z3_params:
            params = list(self.module.parameters())
        if self.config.zero.stage == 3 and not params:
            raise ValueError(
                "load_module_state_dict at ZeRO stage 3 loads into gathered parameters: pass "
                "fetch_z3_params=True (or z3_params_to_fetch=[...])"
            )
        state = checkpoint["module"]
        with zero.GatheredParameters(params, modifier_rank=0, enabled=bool(params)):
            if custom_load_fn is not None:
                custom_load_fn(src=state, dst=self.module)
                return
            result = self.module.load_state_dict(state, strict=strict and not allowed_missing_keys)
        if strict and allowed_missing_keys:
            missing = set(result.missing_keys) - set(allowed_missing_keys)
            if missing or result.unexpected_keys:
                raise RuntimeError(
                    "Checkpoint module state did not match the model outside the allowed missing "
                    f"keys: missing={sorted(missing)}, unexpected={sorted(result.unexpected_keys)}"
                )

    # -- timers and helpers ---------------------------------------------------------------------
    def get_wall_clock_timers(self) -> dict[str, float]:
        """Under `wall_clock_breakdown`, the milliseconds spent in forward, backward and step
        since the last `steps_per_print` line, under DeepSpeed's names (`fwd`, `bwd`, `step`;
        DeepSpeed's per-micro-step and inner timers are not kept); `{}` otherwise."""
        if not self.config.wall_clock_breakdown:
            return {}
        names = {"forward": "fwd", "backward": "bwd", "step": "step"}
        return {names[k]: v * 1e3 for k, v in self.timers.items()}

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collection now (`gc.collect()`: objects found)."""
        return gc.collect()

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        """Whether `obj` indexes and has a length (a map-style dataset)."""
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        """Whether `obj` is a `torch.utils.data.IterableDataset`."""
        return isinstance(obj, torch.utils.data.IterableDataset)


def _count(value: Any) -> int | None:
    """`value` when it is a positive int (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value
