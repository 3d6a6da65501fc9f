"""ZeroConfig: which ZeRO stage runs, and how it buckets its communication.

Our field names carry their units (`reduce_bucket_numel` counts elements, not bytes); the
DeepSpeed `zero_optimization` keys are translated into them once, in
`ZeroConfig.from_section` (each field names the DeepSpeed key it reads: the config pattern,
`minispeed.core.sections`), so a user keeps their ds_config.json and our code keeps clear
names. Unknown keys and contradictory values are errors that name the key as written and the fix.

What each stage keeps per rank (Ψ parameters, N data-parallel ranks, mixed-precision Adam: 2 bytes
per 16-bit parameter, 2 per 16-bit gradient, K = 12 for the fp32 master, momentum and variance):

| stage | bytes kept per rank  | bytes sent per step (ring, per rank, see `ledger.py`)  |
|-------|----------------------|--------------------------------------------------------|
| 0     | 2Ψ + 2Ψ + 12Ψ        | all-reduce of the gradients: 2(N-1)/N · Ψ · g          |
| 1     | 2Ψ + 2Ψ + 12Ψ/N      | reduce-scatter Ψ·g + all-gather Ψ·p, each (N-1)/N      |
| 2     | 2Ψ + 2Ψ/N + 12Ψ/N    | same as stage 1, but reduced while backward runs       |
| 3     | 2Ψ/N + 2Ψ/N + 12Ψ/N  | + one more parameter all-gather (forward and backward) |

(g, p = bytes per gradient / parameter element on the wire; gradients travel in
`MixedPrecision.grad_accum_dtype`, fp32 by default, so g = 4 unless you choose otherwise.)
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from minispeed.core.config import check_top_level_spelling, field_error
from minispeed.core.gradient_buckets import DEFAULT_BUCKET_NUMEL, planned_bucket_numel
from minispeed.core.sections import (
    Section,
    Unsupported,
    build,
    ds_only,
    ds_refused,
    key,
    translate_section,
)

__all__ = ["ZeroConfig"]

_ALL_GATHER_ONLY = "stage-3 parameters are fetched by one all-gather each, never otherwise"
_PERSISTENCE = "one persistence rule, per parameter: use param_persistence_threshold"
_GRANULARITY = "fetch units are modules as written, never merged"
_DEPRECATED = "deprecated by DeepSpeed (false, like its default null, means off)"

# The offload sections' classes, in minispeed.offload (imported only when a section is given).
_OFFLOAD_OPTIMIZER = "minispeed.offload.config:OffloadOptimizerConfig"
_OFFLOAD_PARAM = "minispeed.offload.config:OffloadParamConfig"

# Note [bucket sizes are upper bounds]
# `reduce_bucket_numel` bounds a gradient bucket; the plan cuts buckets of at most
# `BUCKET_CAP_BYTES` (PyTorch DDP's 25 MiB) whatever larger bound is given: the rule is
# `core.gradient_buckets.planned_bucket_numel`, which the profiler's step-time model reads too
# (its default bucket is this plan at the default bound). DeepSpeed's default, 5e8 elements,
# makes one bucket of the whole model, which costs three ways, measured at 33.9M
# parameters on 2 gloo ranks: (1) nothing is reduced until backward ends (no overlap); (2) a
# transient bucket (stage 2's staging, stage 3's) of Ψ elements is a fresh allocation each step,
# and above glibc's largest mmap threshold (32 MiB) every one comes back from the kernel as new
# zeroed pages: +60 ms CPU per step for 136 MB; (3) gloo's reduce-scatter allocates a buffer of
# the input's size inside each call, the same cost again (33,204 page faults per call at 34M
# elements, none at 6.5M). Buckets at or below 25 MiB are reused by the allocator and overlap with
# backward, like DDP's. The bytes sent are the same; only the number of calls grows (at most
# Ψ·g / 25 MiB calls, five for 33.9M fp32 parameters). Smaller bounds are taken as given.

# Note [overlap_comm's default]
# When a DeepSpeed config leaves `overlap_comm` out, DeepSpeed turns it on at stage 3 only. Its
# reason at stages 1-2 is memory: overlapping keeps a second reduction bucket alive while the
# first is in flight. minispeed's stage 2 pays the same (up to `_MAX_IN_FLIGHT` staging buckets
# in flight, reducer.py), so it keeps DeepSpeed's default there. Stages 0 and 1 reduce in place
# in the flat gradient buffer that exists anyway, so overlapping costs them no buffer of
# minispeed's own, and the key left out means "on" (the one extra cost is gloo's: its
# reduce-scatter copies its input inside each call, so with overlap up to one copy per bucket
# in flight, at most Ψ·g bytes, is alive at once instead of one). Measured at 33.9M parameters
# on 2 gloo ranks (docs/benchmarks.md), overlapping made stage 1's step 1 % faster in wall
# time and 4-5 % in CPU time, which puts it at DDP's speed. `overlap_comm: false`, written out,
# is honoured at every stage: each bucket is then reduced synchronously in its hook.


@dataclass(frozen=True)
class ZeroConfig(Section):
    """ZeRO: which stage, its buckets, offload and ZeRO++ (DeepSpeed `zero_optimization`).

    Build it directly or with `from_section`. Validation happens in `__post_init__`; every error
    says which field is wrong and how to fix it. Buffers sized from the bucket fields are capped
    at the model size, so the large DeepSpeed defaults cost nothing on a small model.
    """

    ds_path: ClassVar[str] = "zero_optimization"
    ds_auto_is_default: ClassVar[bool] = True  # DeepSpeed: "auto" is the default
    # DeepSpeed keys ZeRO implements at one value only: accepted at that value (its default).
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "allgather_partitions": ds_only(
            True, "parameters are all-gathered, never a chain of broadcasts"
        ),
        "round_robin_gradients": ds_only(
            False, "gradients are reduced in bucket order, not round-robin"
        ),
        "allgather_sequential": ds_only(False, _ALL_GATHER_ONLY),
        "stage3_allgather_sequential": ds_only(False, _ALL_GATHER_ONLY),
        "use_all_reduce_for_fetch_params": ds_only(False, _ALL_GATHER_ONLY),
        "stage3_use_all_reduce_for_fetch_params": ds_only(False, _ALL_GATHER_ONLY),
        "model_persistence_threshold": ds_only(sys.maxsize, _PERSISTENCE),
        "stage3_model_persistence_threshold": ds_only(sys.maxsize, _PERSISTENCE),
        "module_granularity_threshold": ds_only(0, _GRANULARITY),
        "stage3_module_granularity_threshold": ds_only(0, _GRANULARITY),
        "leaf_module": ds_refused(
            "leaf modules are set in code: deepspeed.utils.set_z3_leaf_modules(model, classes) "
            "or minispeed.zero.set_leaf_module"
        ),
        # DeepSpeed's default is null; false, which old configs write, means the same there.
        "cpu_offload": ds_only(False, f"{_DEPRECATED}; use offload_optimizer: {{device: cpu}}"),
        "cpu_offload_param": ds_only(False, f"{_DEPRECATED}; use offload_param: {{device: cpu}}"),
        "cpu_offload_use_pin_memory": ds_only(
            False, f"{_DEPRECATED}; use offload_optimizer / offload_param pin_memory"
        ),
        "legacy_stage1": ds_only(False, "DeepSpeed's old stage-1 code path; use stage: 1"),
        "elastic_checkpoint": ds_only(
            False, "ignored by DeepSpeed's ZeRO itself; checkpoints load at any world size"
        ),
        "load_from_fp32_weights": ds_only(
            True, "a checkpoint always loads its fp32 masters (the 16-bit weights follow)"
        ),
        "compute_grad_norm": ds_only(
            True, "the norm is computed when clipping or asked for (engine.get_global_grad_norm)"
        ),
        "enable_sanity_checks": ds_only(False, "the checks that matter always run"),
        "log_trace_cache_warnings": ds_only(
            False, "a changed module order is re-traced or raises, never only logged"
        ),
        "override_module_apply": ds_only(True, "zero.Init always gathers for module.apply"),
        "parameter_alignment": ds_only(
            False, "partitions are cut at elements, with no alignment padding"
        ),
        "pipeline_loading_checkpoint": ds_only(
            False, "no ZeRO-3 pipeline-module loading path; use engine.load_checkpoint"
        ),
        "memory_efficient_linear": ds_only(
            True,
            "torch's linear is kept (DeepSpeed's saves activation memory, same values)",
            also=(False,),  # DeepSpeed's switch to torch's linear: minispeed's already
        ),
        "save_muon_momentum_buffer_in_memory": ds_only(False, "no Muon optimizer"),
        "use_multi_rank_bucket_allreduce": ds_only(True, "one reduce path per stage"),
        "zero_quantized_nontrainable_weights": ds_only(
            False, "frozen weights stay unquantized; use zero_quantized_weights for all"
        ),
        "zeropp_loco_param": ds_refused(
            "LoCo's error feedback for ZeRO++'s quantized gradients (DeepSpeed 0.19.8 removed "
            "it too); use zero_quantized_gradients without it"
        ),
        "zenflow": ds_only(
            None, "DeepSpeed's ZenFlow (stale-gradient CPU updates); use offload_optimizer"
        ),
    }

    stage: int = key("stage", 0, schema={"enum": [0, 1, 2, 3]})
    """0 = plain data parallel (bucketed all-reduce), 1 = + optimizer states partitioned, 2 = +
    gradients partitioned, 3 = + parameters partitioned (DeepSpeed `stage`)."""
    reduce_bucket_numel: int = key("reduce_bucket_size", DEFAULT_BUCKET_NUMEL)
    """Most elements per gradient-reduction bucket (DeepSpeed `reduce_bucket_size`, which counts
    elements too). Smaller buckets overlap more with backward; larger ones make fewer calls. An
    upper bound: buckets are cut at 25 MiB at most (`bucket_numel`, Note [bucket sizes are upper
    bounds])."""
    allgather_bucket_numel: int = key("allgather_bucket_size", DEFAULT_BUCKET_NUMEL)
    """Elements per parameter all-gather call after the step, stages 1-2 (DeepSpeed
    `allgather_bucket_size`)."""
    overlap_comm: bool = key(
        "overlap_comm",
        True,
        derived="Left out: on, except at stage 2 (Note [overlap_comm's default]).",
    )
    """Launch gradient collectives asynchronously from the gradient hooks so they run while
    backward continues (DeepSpeed `overlap_comm`). False: each bucket is reduced synchronously
    in its hook."""
    contiguous_gradients: bool = key("contiguous_gradients", True)
    """DeepSpeed `contiguous_gradients`: copy each gradient, as autograd produces it, into a
    contiguous buffer (and free `param.grad`), so that one collective reduces a bucket and
    backward leaves no scattered gradient tensors. minispeed always does this (stages 0-2: views
    of one flat buffer per param group; stage 3: one buffer per bucket): it is how buckets are
    reduced. `False` is refused, since it cannot be honoured."""
    reduce_scatter: bool = key("reduce_scatter", True)
    """Stages 1-2: average gradients with reduce-scatter (each rank receives only its partition).
    False: all-reduce each bucket and keep this rank's part (twice the bytes; DeepSpeed
    `reduce_scatter`)."""
    ignore_unused_parameters: bool = key("ignore_unused_parameters", True)
    """Tolerate parameters that get no gradient on any rank in an accumulation window (they are
    left untouched by the step, as torch.optim does for `grad is None`). False: raise instead
    (DeepSpeed `ignore_unused_parameters`)."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step (DeepSpeed top-level `gradient_accumulation_steps`)."""
    max_grad_norm: float = 0.0
    """Clip gradients to this global L2 norm before the step; 0 disables (DeepSpeed top-level
    `gradient_clipping`); `math.inf` computes the norm (`ZeroOptimizer.global_grad_norm`) and
    leaves the gradients as they are."""
    sub_group_numel: int = key("sub_group_size", 1_000_000_000)
    """Most master elements the inner optimizer steps in one call, every stage (DeepSpeed
    `sub_group_size`, which DeepSpeed reads for stage 3 only): bounds the step's temporaries to
    about max(sub_group_numel, largest fragment)·4 bytes per temporary instead of Ψ/N·4, at one
    `optimizer.step()` call per sub-group (0: one per parameter, as DeepSpeed). See Note [optimizer
    sub-groups] in optimizer.py."""

    # -- stage 3 (read by minispeed.zero.stage3) ------------------------------------------------
    # Each stage3_* key also under its DeepSpeed pydantic field name (DeepSpeed takes both).
    stage3_prefetch_bucket_numel: int = key(
        "stage3_prefetch_bucket_size", 50_000_000, aliases=("prefetch_bucket_size",)
    )
    """Most elements fetched ahead of use by the stage-3 prefetcher (`stage3_prefetch_bucket_size`);
    at most one 4M-element chunk is ahead at a time whatever this says (Note [a prefetch stays one
    chunk ahead] in stage3/prefetch.py); 0: no prefetch."""
    stage3_param_persistence_threshold_numel: int = key(
        "stage3_param_persistence_threshold", 100_000, aliases=("param_persistence_threshold",)
    )
    """Parameters with at most this many elements stay gathered on every rank
    (`stage3_param_persistence_threshold`)."""
    stage3_max_live_numel: int = key(
        "stage3_max_live_parameters", 1_000_000_000, aliases=("max_live_parameters",)
    )
    """Upper bound on gathered parameter elements alive at once (`stage3_max_live_parameters`);
    it stops prefetching, never a fetch a module needs (0: no prefetch)."""
    stage3_max_reuse_distance_numel: int = key(
        "stage3_max_reuse_distance", 1_000_000_000, aliases=("max_reuse_distance",)
    )
    """Keep a gathered parameter if it is used again within this many parameter elements
    (`stage3_max_reuse_distance`)."""
    stage3_gather_16bit_weights_on_model_save: bool = key(
        "stage3_gather_16bit_weights_on_model_save",
        False,
        aliases=(
            "stage3_gather_fp16_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
        ),
    )
    """Gather full 16-bit weights when the model is saved
    (`stage3_gather_16bit_weights_on_model_save`)."""
    stage3_trace_check: str = "first"
    """Stage 3: how ranks check that they fetch parameters in the same order (our own setting, no
    DeepSpeed key): `"first"` checks every module while the first trace is recorded, then one
    cheap check per forward; `"every"` checks every module of every pass (debug); `"off"`
    checks nothing, so a divergence hangs until the collective timeout. The environment
    variable `MINISPEED_ZERO3_TRACE_CHECK` overrides it for one run."""

    # -- ZeRO++ (stage 3 only; read by minispeed.zero.stage3.zeropp) -----------------------------
    quantized_weights: bool = key("zero_quantized_weights", False)
    """qwZ: stage 3's parameter all-gathers send int8 block-quantized shards; the fp32/bf16
    masters stay exact, the gathered copy is dequantized (DeepSpeed `zero_quantized_weights`)."""
    hpz_partition_size: int = key("zero_hpz_partition_size", 1)
    """hpZ: keep a secondary copy of each parameter split over this many ranks of one node, so
    backward's all-gather stays inside the node; 1 = off. Must equal the node size
    (`LOCAL_WORLD_SIZE`) and divide the world (DeepSpeed `zero_hpz_partition_size`)."""
    quantized_gradients: bool = key("zero_quantized_gradients", False)
    """qgZ: gradients reduce-scattered in int8 (or `quantized_gradient_bits=4`) through a
    two-hop all-to-all, inside each node then across nodes (DeepSpeed
    `zero_quantized_gradients`)."""
    quant_block_numel: int = 256
    """ZeRO++: elements sharing one fp32 scale in qwZ and qgZ (our own setting, no DeepSpeed key):
    a power of two, at least 8."""
    quantized_gradient_bits: int = 8
    """qgZ: 8 (int8) or 4 (int4) bits per gradient element on the wire (our own setting)."""

    # -- MiCS (stage 3 only; read by minispeed.zero.stage3.mics) -----------------------------------
    mics_shard_size: int = key("mics_shard_size", -1)
    """MiCS: partition parameters, gradients and optimizer states over groups of this many
    data-parallel ranks (typically one node) and replicate them across the groups; gradients
    are reduce-scattered inside a group, then all-reduced across groups. -1 = off (plain ZeRO-3
    over every rank). Must divide the data-parallel size (DeepSpeed `mics_shard_size`, which
    DeepSpeed 0.19.8 removed; minispeed keeps its meaning)."""
    mics_hierarchical_params_gather: bool = key("mics_hierarchical_params_gather", False)
    """MiCS: gather parameters in two levels, inside each node then across nodes, when a shard
    group spans several nodes (`mics_shard_size` a multiple of `LOCAL_WORLD_SIZE`; DeepSpeed
    `mics_hierarchical_params_gather`)."""

    # -- offload (needs minispeed-offload: `pip install packages/zero[offload]`) ----------------
    offload_optimizer: Any = key("offload_optimizer", None, section=_OFFLOAD_OPTIMIZER)
    """`None`, or a `minispeed.offload.OffloadOptimizerConfig` with device `cpu` or `nvme`
    (DeepSpeed `offload_optimizer`): fp32 masters and optimizer states on the host, stepped
    by the CPU Adam; with `nvme` the states live in swap files. Stages 1-3. See
    `minispeed.zero.offload_bridge`."""
    offload_param: Any = key("offload_param", None, section=_OFFLOAD_PARAM)
    """`None`, or a `minispeed.offload.OffloadParamConfig` with device `cpu` or `nvme`
    (DeepSpeed `offload_param`, ZeRO-Infinity): stage 3's parameter shards live off the
    accelerator (host memory or swap files) and are fetched before each all-gather. Stage 3."""
    aio: Any = None
    """`None` (defaults), or a `minispeed.offload.AioConfig` (DeepSpeed top-level `aio`): how
    swap files are read and written when a device is `nvme`."""

    def bucket_numel(self, element_size: int) -> int:
        """Elements per gradient bucket as planned: `reduce_bucket_numel`, at most
        `core.gradient_buckets.BUCKET_CAP_BYTES` of `element_size`-byte elements
        (`planned_bucket_numel`: Note [bucket sizes are upper bounds])."""
        return planned_bucket_numel(self.reduce_bucket_numel, element_size)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stage not in (0, 1, 2, 3):
            raise field_error(self, "stage", f"must be 0, 1, 2 or 3, got {self.stage}")
        if not self.contiguous_gradients:
            raise field_error(
                self,
                "contiguous_gradients",
                "False is not supported: minispeed always copies gradients into contiguous "
                "bucket buffers as backward produces them, since each bucket is reduced by one "
                "collective over that buffer; set it to True or remove the key",
            )
        for name in (
            "reduce_bucket_numel",
            "allgather_bucket_numel",
            "gradient_accumulation_steps",
        ):
            if getattr(self, name) < 1:
                raise field_error(
                    self,
                    name,
                    f"must be >= 1, got {getattr(self, name)}; a bucket holds at least one "
                    f"element (use a positive count, e.g. 500_000_000)",
                )
        # 0 is DeepSpeed's too (axolotl's and others' configs write it): no prefetch, nothing
        # kept gathered past its use, one sub-group per parameter, nothing persistent or reused.
        for name in (
            "stage3_prefetch_bucket_numel",
            "stage3_max_live_numel",
            "sub_group_numel",
            "stage3_param_persistence_threshold_numel",
            "stage3_max_reuse_distance_numel",
        ):
            if getattr(self, name) < 0:
                raise field_error(self, name, f"must be >= 0, got {getattr(self, name)}")
        if self.stage3_trace_check not in ("off", "first", "every"):
            raise field_error(
                self,
                "stage3_trace_check",
                f"must be 'first' (default), 'every' (debug) or 'off', got "
                f"{self.stage3_trace_check!r}",
            )
        if self.max_grad_norm < 0:
            raise field_error(
                self,
                "max_grad_norm",
                f"must be >= 0 (0 disables clipping), got {self.max_grad_norm}",
            )
        _check_zeropp_fields(self)
        _check_mics_fields(self)
        if self.offload_optimizer is not None or self.offload_param is not None:
            # Lazy: no offload import unless a section asks for it.
            from minispeed.zero.offload_bridge import check_offload

            check_offload(self)

    @classmethod
    def from_ds_config(cls, ds_config: dict[str, Any]) -> ZeroConfig:
        """Deprecated (use `from_section`, or the engine's `EngineConfig`): ZeRO's sections
        picked out of a whole ds_config: `zero_optimization` (missing: stage 0), `aio` and the
        top-level `gradient_accumulation_steps` and `gradient_clipping` (missing: 0, off). A near
        miss of one of those top-level names (`"zero_optimisation"`) is an error naming the key
        meant."""
        warnings.warn(
            "ZeroConfig.from_ds_config is deprecated: use ZeroConfig.from_section("
            "ds_config['zero_optimization'], gradient_accumulation_steps=..., max_grad_norm=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        if not isinstance(ds_config, dict):
            raise TypeError(
                f"ds_config must be a dict (the parsed ds_config.json), got {type(ds_config).__name__}"
            )
        check_top_level_spelling(ds_config, _DS_SECTIONS, "ZeroConfig.from_ds_config")
        gas = ds_config.get("gradient_accumulation_steps", 1)
        return cls.from_section(
            ds_config.get("zero_optimization"),
            gradient_accumulation_steps=int(gas) if isinstance(gas, float) else gas,
            max_grad_norm=ds_config.get("gradient_clipping", 0.0),
            aio=ds_config.get("aio"),
        )

    @classmethod
    def from_section(
        cls,
        section: Mapping[str, Any] | None = None,
        *,
        path: str | None = None,
        gradient_accumulation_steps: int = 1,
        max_grad_norm: float = 0.0,
        aio: Any = None,
    ) -> ZeroConfig:
        """ZeRO's own section, `zero_optimization` (None: stage 0), with the three values it
        needs from elsewhere in the ds_config: the accumulation steps, the clipping norm
        (DeepSpeed's top-level `gradient_clipping`, 0 = off) and the top-level `aio` section
        (a dict or a `minispeed.offload.AioConfig`) for NVMe offload.

        An unknown key is a `ConfigError` with its path and the nearest known key; a DeepSpeed
        key ZeRO implements at one value only (`allgather_partitions`, `round_robin_gradients`)
        is accepted at that value. A missing `overlap_comm` means on, except at stage 2
        (DeepSpeed: on at stage 3 only; see Note [overlap_comm's default]); written out, it is
        honoured. An offload section whose device is `none` becomes None; its keys are still
        checked where minispeed-offload is installed (Note [offload is imported lazily]).
        """
        from minispeed.zero.offload_bridge import ignore_offload_misfits, offload_sections

        path = cls.ds_path if path is None else path
        section = offload_sections(section, path)  # before any import of offload
        kwargs = translate_section(cls, section, path)
        stage = kwargs.get("stage", 0)
        if "overlap_comm" not in kwargs:
            kwargs["overlap_comm"] = stage != 2  # Note [overlap_comm's default]
        # A device `none`, or one the stage cannot honour (dropped with a warning), is None.
        asked = [getattr(kwargs.get(name), "device", None) for name in _OFFLOAD_KEYS]
        devices = ignore_offload_misfits(
            stage, [d if d != "none" else None for d in asked], path=path
        )
        for name, device in zip(_OFFLOAD_KEYS, devices, strict=True):
            if device is None:
                kwargs[name] = None
        if any(devices):
            from minispeed.zero.offload_bridge import import_offload

            aio_class = import_offload("aio").AioConfig
            kwargs["aio"] = aio if isinstance(aio, aio_class) else aio_class.from_section(aio)
        kwargs.update(
            gradient_accumulation_steps=gradient_accumulation_steps, max_grad_norm=max_grad_norm
        )
        return build(cls, path, kwargs, section)


def _check_zeropp_fields(cfg: ZeroConfig) -> None:
    """The ZeRO++ fields alone; what depends on the world and the model is checked at shard()
    (stage3/zeropp.py)."""
    on = [
        name
        for name, value in (
            ("quantized_weights", cfg.quantized_weights),
            ("quantized_gradients", cfg.quantized_gradients),
            ("hpz_partition_size", cfg.hpz_partition_size != 1),
        )
        if value
    ]
    if on and cfg.stage != 3:
        raise field_error(
            cfg,
            on[0],
            f"ZeRO++ (zero_quantized_weights / zero_hpz_partition_size / zero_quantized_gradients) "
            f"partitions stage 3's parameter and gradient traffic, but stage={cfg.stage}; set "
            f"stage to 3 or remove the ZeRO++ keys",
        )
    if cfg.hpz_partition_size < 1:
        raise field_error(
            cfg,
            "hpz_partition_size",
            f"must be >= 1 (1 = off; DeepSpeed zero_hpz_partition_size), got "
            f"{cfg.hpz_partition_size}; use the number of ranks per node",
        )
    b = cfg.quant_block_numel
    if b < 8 or b & (b - 1):
        raise field_error(
            cfg,
            "quant_block_numel",
            f"must be a power of two >= 8 (the block of zero_quantized_weights / "
            f"zero_quantized_gradients), got {b}: other sizes split rows of power-of-two hidden "
            f"sizes unevenly; use 256 (the default) or 64",
        )
    if cfg.quantized_gradient_bits not in (8, 4):
        raise field_error(
            cfg, "quantized_gradient_bits", f"must be 8 or 4, got {cfg.quantized_gradient_bits}"
        )


def _check_mics_fields(cfg: ZeroConfig) -> None:
    """The MiCS fields alone; what depends on the world is checked at shard() (stage3/mics.py)."""
    s = cfg.mics_shard_size
    if s == 0 or s < -1:
        raise field_error(
            cfg,
            "mics_shard_size",
            f"must be -1 (off) or a group size >= 1, got {s}; use the number of ranks per node",
        )
    if s > 0 and cfg.stage != 3:
        raise field_error(
            cfg,
            "mics_shard_size",
            f"mics_shard_size={s} shards stage 3's parameters inside groups, but stage="
            f"{cfg.stage}; set stage to 3 or remove mics_shard_size",
        )
    if cfg.mics_hierarchical_params_gather and s < 1:
        raise field_error(
            cfg,
            "mics_hierarchical_params_gather",
            "gathers inside MiCS shard groups, but mics_shard_size is off; set "
            "mics_shard_size, or remove the key",
        )


_OFFLOAD_KEYS = ("offload_optimizer", "offload_param")  # offload_misfits' argument order
# The top-level ds_config keys ZeroConfig.from_ds_config reads.
_DS_SECTIONS = {"zero_optimization", "gradient_accumulation_steps", "gradient_clipping", "aio"}
