"""Mixed precision: 16-bit model parameters, fp32 master weights, and fp16's dynamic loss scale.

Three modes, chosen by `MixedPrecision.param_dtype`:

- fp32: parameters, gradients and masters in fp32 (stage 0 keeps no separate master copy).
- bf16: parameters in bf16; the optimizer steps fp32 masters; gradients are accumulated and
  reduced in `grad_accum_dtype` (fp32 unless you ask for bf16: bf16 has 8 mantissa bits, so
  summing many micro-batches in it loses the small contributions).
- fp16: as bf16, plus a loss scale: fp16's range ends at 65504 and its smallest normal is 6e-5,
  so small gradients underflow unless the loss is multiplied by `S` before backward and the
  gradients divided by `S` after. `LossScaler` picks `S` dynamically.

Bytes kept per parameter: param_dtype (2 or 4) for the model, grad_accum_dtype (2 or 4) for the
gradient, 4 for the fp32 master (none for fp32 stage 0) plus the optimizer's state (8 for Adam).
The loss scaler keeps a few Python numbers.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from minispeed.core.config import ConfigError, check_top_level_spelling, field_error
from minispeed.core.logging import get_logger
from minispeed.core.sections import Section, Unsupported, ds_keys, ds_only, key
from minispeed.zero.autocast import Autocast, TorchAutocastConfig

__all__ = ["Bf16Config", "DataTypesConfig", "Fp16Config", "LossScaler", "MixedPrecision"]

# The top-level ds_config sections MixedPrecision.from_ds_config reads.
_SECTIONS = {"fp16", "bf16", "bfloat16", "data_types"}
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
}
# DeepSpeed still reads its old name of the bf16 section.
_BF16_OLD = "bfloat16"


def _switch(section: str) -> Any:
    """`enabled` as DeepSpeed 0.19.8 reads it: `"auto"` (the Hugging Face Trainer's placeholder,
    left in a config used without the Trainer) is off there, so it is off here, with a warning;
    0 and 1 are false and true; any other non-boolean is an error."""

    def read(value: Any) -> bool:
        if value == "auto":
            _log.warning(
                '%s.enabled is "auto" (a placeholder the Hugging Face Trainer fills in): read as '
                "false, as DeepSpeed reads it; set true or false",
                section,
            )
            return False
        if not isinstance(value, bool | int):
            raise TypeError(f"must be true or false, got {value!r}")
        return bool(value)

    return read


def _dtype_name(value: Any) -> str | None:
    """`"float16"`, `"half"`, ... -> `"fp16"` (None stays None: the default)."""
    if value is None:
        return None
    text = _DTYPE_ALIASES.get(str(value).lower(), str(value).lower())
    if text not in _DTYPES:
        raise ValueError(f"{value!r} is not a dtype we know; use one of {sorted(_DTYPES)}")
    return text


_FP32_MASTERS = "our masters (and the optimizer states) stay fp32 under fp16 and bf16"


@dataclass(frozen=True)
class Fp16Config(Section):
    """fp16 mixed precision with a dynamic loss scale (DeepSpeed section `fp16`; its keys are
    read only when `enabled`)."""

    ds_path: ClassVar[str] = "fp16"
    ds_auto_is_default: ClassVar[bool] = True  # DeepSpeed: "auto" is the default
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "fp16_master_weights_and_grads": ds_only(False, _FP32_MASTERS),
    }

    enabled: bool = key("enabled", False, read=_switch("fp16"))
    """Train in fp16: 16-bit parameters, fp32 masters, a loss scale."""
    loss_scale: float = key("loss_scale", 0.0)
    """0: scale dynamically; > 0: this static scale (`MixedPrecision.static_loss_scale`)."""
    initial_scale_power: int = key("initial_scale_power", 16)
    """The dynamic scale starts at `2 ** initial_scale_power`."""
    loss_scale_window: int = key("loss_scale_window", 1000)
    """Clean steps before the dynamic scale doubles."""
    hysteresis: int = key("hysteresis", 2)
    """Overflows tolerated before the scale is lowered (1 = lower at the first)."""
    consecutive_hysteresis: bool = key("consecutive_hysteresis", False)
    """Refill the hysteresis budget after every clean step (else after a raise)."""
    min_loss_scale: float = key("min_loss_scale", 1.0)
    """The dynamic scale never goes below this."""
    raise_error_at_min_scale: bool = key("raise_error_at_min_scale", True)
    """An overflow while the scale is already at `min_loss_scale` raises `FloatingPointError`
    (DeepSpeed's default: such a run usually skips every step from then on); false: log a
    warning, skip the step and go on."""
    auto_cast: bool = key("auto_cast", False)
    """The engine's `forward` casts every floating-point tensor among its positional arguments
    (inside tuples, lists and dicts too) to fp16 before calling the model, as DeepSpeed's does,
    and a pipeline the first stage's inputs of each micro-batch; keyword arguments and labels
    pass as given. accelerate writes it (`"auto_cast": true`) when
    `mixed_precision="fp16"` meets a DeepSpeed config without an `fp16` section. Read by the
    engine only: `zero.shard` takes the inputs the script passes. Cost: one cast per floating
    input, none when the inputs are already fp16."""


@dataclass(frozen=True)
class Bf16Config(Section):
    """bf16 mixed precision (DeepSpeed section `bf16`, or its old name `bfloat16`)."""

    ds_path: ClassVar[str] = "bf16"
    ds_auto_is_default: ClassVar[bool] = True  # DeepSpeed: "auto" is the default
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "bf16_master_weights_and_grads": ds_only(False, _FP32_MASTERS),
        "bf16_optimizer_states": ds_only(False, _FP32_MASTERS),
        "immediate_grad_update": ds_only(
            False, "gradients are accumulated into the reduce buckets, one path"
        ),
    }

    enabled: bool = key("enabled", False, read=_switch("bf16"))
    """Train in bf16: 16-bit parameters, fp32 masters, no loss scale."""
    check_grad_overflow: bool = key("check_grad_overflow", True)
    """Skip a step whose gradients hold an inf or a NaN on any rank (counted in
    `skipped_steps`, the norm reported infinite, the LR scheduler not stepped). False lets the
    NaN into every weight, as DeepSpeed does at ZeRO-1/2; at stages 0 and 3 bf16 steps are
    checked either way, as DeepSpeed's there (`MixedPrecision.check_grad_overflow`)."""


@dataclass(frozen=True)
class DataTypesConfig(Section):
    """Data types (DeepSpeed section `data_types`)."""

    ds_path: ClassVar[str] = "data_types"
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "param_dtype": ds_only(None, "the parameters' dtype comes from fp16 / bf16"),
        "buffer_dtype": ds_only(None, "the buffers' dtype comes from fp16 / bf16"),
        "keep_in_fp32_modules": ds_only(
            [],
            "no per-module fp32 exceptions: every parameter takes the fp16 / bf16 dtype "
            "(DeepSpeed's default, \"auto\", keeps a Hugging Face model's "
            "_keep_in_fp32_modules in fp32 under ZeRO-3); only [], which says so, is accepted",
        ),
    }

    grad_accum_dtype: str | None = key(
        "grad_accum_dtype", None, read=_dtype_name, schema={"enum": ["fp32", "fp16", "bf16", None]}
    )
    """The dtype gradients are accumulated across micro-steps and reduced in (`fp32`, `fp16`,
    `bf16`); left out: fp32 (`MixedPrecision.grad_accum_dtype`)."""


@dataclass(frozen=True)
class MixedPrecision:
    """Which dtypes the model, its gradients and the loss scale use.

    `grad_accum_dtype` (DeepSpeed `data_types.grad_accum_dtype`) is the dtype gradients are
    accumulated across micro-steps *and* reduced in; it is fp32 by default for every mode, so bf16
    training never silently accumulates in bf16. Choose `param_dtype` for it to halve the
    gradient buffers and the bytes sent (DeepSpeed's fp16 behaviour).

    The `*loss_scale*` / `hysteresis` fields matter only for fp16 (DeepSpeed `fp16` section,
    same names and meanings).
    """

    param_dtype: torch.dtype = torch.float32
    """dtype of the model's parameters (and of its activations): fp32, bf16 or fp16."""
    grad_accum_dtype: torch.dtype = torch.float32
    """dtype gradients are accumulated and reduced in (fp32 by default; see the class docstring)."""
    static_loss_scale: float | None = None
    """fp16 only: a fixed loss scale; `None` (DeepSpeed `loss_scale: 0`) scales dynamically."""
    initial_scale_power: int = 16
    """fp16, dynamic: the first scale is `2 ** initial_scale_power`."""
    loss_scale_window: int = 1000
    """fp16, dynamic: double the scale after this many consecutive steps without overflow."""
    hysteresis: int = 2
    """fp16, dynamic: overflows tolerated before the scale is lowered (1 = lower at the first)."""
    consecutive_hysteresis: bool = False
    """fp16, dynamic: refill the hysteresis budget after every clean step (else after a raise)."""
    min_loss_scale: float = 1.0
    """fp16, dynamic: the scale never goes below this."""
    check_grad_overflow: bool = True
    """bf16 at ZeRO-1/2: skip a step whose gradients hold an inf or a NaN (ds_config
    `bf16.check_grad_overflow`); see `LossScaler.checks` for every stage and dtype."""
    raise_error_at_min_scale: bool = True
    """fp16, dynamic: an overflow while the scale is already at `min_loss_scale` raises
    `FloatingPointError` (DeepSpeed's default: such a run usually skips every step from then
    on). False: log a warning, skip the step and go on. ds_config key
    `fp16.raise_error_at_min_scale` (DeepSpeed's `DynamicLossScaler` argument of that name)."""
    autocast: Autocast | None = None
    """Forward under `torch.autocast` with fp32 parameters (autocast.py; ds_config section
    `torch_autocast`); only with `param_dtype` fp32."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "grad_accum_dtype"):
            if getattr(self, name) not in _DTYPES.values():
                raise field_error(
                    self,
                    name,
                    f"must be torch.float32, torch.bfloat16 or torch.float16, got "
                    f"{getattr(self, name)}",
                )
        if self.param_dtype == torch.float32 and self.grad_accum_dtype != torch.float32:
            raise field_error(
                self,
                "grad_accum_dtype",
                f"fp32 parameters produce fp32 gradients; accumulating them in "
                f"{self.grad_accum_dtype} only loses precision: set grad_accum_dtype=torch.float32 "
                "(data_types.grad_accum_dtype: fp32), or train in bf16/fp16",
            )
        if self.autocast is not None and self.param_dtype != torch.float32:
            raise field_error(
                self,
                "autocast",
                f"autocast keeps the parameters fp32, and param_dtype is {self.param_dtype}: "
                "train with one of them (torch_autocast, or bf16 / fp16)",
            )
        if self.static_loss_scale is not None and not self.uses_loss_scaling:
            raise field_error(
                self,
                "static_loss_scale",
                "static_loss_scale only applies to fp16; remove it or set "
                "param_dtype=torch.float16",
            )
        if self.static_loss_scale is not None and not self.static_loss_scale > 0:
            raise field_error(
                self,
                "static_loss_scale",
                f"must be > 0 (fp16.loss_scale 0 scales dynamically), got {self.static_loss_scale}",
            )
        if self.loss_scale_window < 1:
            raise field_error(
                self, "loss_scale_window", f"must be >= 1 step, got {self.loss_scale_window}"
            )
        if self.hysteresis < 1:
            raise field_error(
                self,
                "hysteresis",
                f"must be >= 1 (1 = lower the scale at the first overflow), got {self.hysteresis}",
            )
        if not self.min_loss_scale > 0:
            raise field_error(self, "min_loss_scale", f"must be > 0, got {self.min_loss_scale}")
        if 2.0**self.initial_scale_power < self.min_loss_scale:
            raise field_error(
                self,
                "initial_scale_power",
                f"initial scale 2**{self.initial_scale_power} is below min_loss_scale="
                f"{self.min_loss_scale}; raise initial_scale_power or lower min_loss_scale",
            )

    @property
    def uses_loss_scaling(self) -> bool:
        """Only fp16 needs a loss scale (bf16 has fp32's exponent range): fp16 parameters, or an
        fp16 autocast forward."""
        return self.param_dtype == torch.float16 or (
            self.autocast is not None and self.autocast.scales_loss
        )

    @property
    def needs_master_copy(self) -> bool:
        """Whether the optimizer steps a separate fp32 copy of the 16-bit parameters."""
        return self.param_dtype != torch.float32

    @classmethod
    def from_ds_config(cls, ds_config: dict[str, Any]) -> MixedPrecision:
        """Deprecated (use `from_sections`, or the engine's `EngineConfig`): DeepSpeed's `fp16`,
        `bf16` (or its old name `bfloat16`) and `data_types` sections picked out of a whole
        ds_config; a near miss of one of those top-level names (`"fp_16"`) is an error naming
        the key meant."""
        warnings.warn(
            "MixedPrecision.from_ds_config is deprecated: use MixedPrecision.from_sections(fp16=..., "
            "bf16=..., data_types=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        check_top_level_spelling(ds_config, _SECTIONS, "MixedPrecision.from_ds_config")
        if "bf16" in ds_config and _BF16_OLD in ds_config:
            raise ConfigError(
                _BF16_OLD, "the old name of 'bf16', which is also set; keep only 'bf16'"
            )
        return cls.from_sections(
            fp16=ds_config.get("fp16"),
            bf16=ds_config.get("bf16", ds_config.get(_BF16_OLD)),
            data_types=ds_config.get("data_types"),
        )

    @classmethod
    def from_sections(
        cls,
        fp16: Fp16Config | Mapping[str, Any] | None = None,
        bf16: Bf16Config | Mapping[str, Any] | None = None,
        data_types: DataTypesConfig | Mapping[str, Any] | None = None,
        torch_autocast: TorchAutocastConfig | Mapping[str, Any] | None = None,
    ) -> MixedPrecision:
        """Mixed precision from its four ds_config sections, `fp16`, `bf16`, `data_types` and
        `torch_autocast` (each a section object, its dict, or None: absent). fp16's keys are
        read only when it is enabled.

        Both `fp16.enabled` and `bf16.enabled` true is a contradiction and an error, and so is
        either with `torch_autocast.enabled` (autocast keeps the parameters fp32; DeepSpeed
        0.19.8 accepts bf16 with it and runs a bf16 model under autocast: choose one here); a
        bad key or value is a `ConfigError` naming the key as written (`fp16.loss_scale`), the
        value and the fix, with this class's field in parentheses.
        """
        if not isinstance(torch_autocast, TorchAutocastConfig):
            torch_autocast = TorchAutocastConfig.from_section(torch_autocast)
        fp16 = fp16 if isinstance(fp16, Fp16Config) else Fp16Config.from_section(fp16)
        bf16 = bf16 if isinstance(bf16, Bf16Config) else Bf16Config.from_section(bf16)
        if not isinstance(data_types, DataTypesConfig):
            data_types = DataTypesConfig.from_section(data_types)
        if fp16.enabled and bf16.enabled:
            raise ConfigError(
                "bf16.enabled",
                "true, and so is fp16.enabled; enable at most one of fp16 and bf16",
            )
        for name, section in (("bf16", bf16), ("fp16", fp16)):
            if section.enabled and torch_autocast.enabled:
                raise ConfigError(
                    "torch_autocast.enabled",
                    f"true, and so is {name}.enabled: torch_autocast trains fp32 parameters under "
                    f"torch.autocast, {name} trains {name} parameters; set one of "
                    f"torch_autocast.enabled and {name}.enabled to false",
                )
        param_dtype = (
            torch.float16 if fp16.enabled else torch.bfloat16 if bf16.enabled else torch.float32
        )
        kwargs: dict[str, Any] = {"param_dtype": param_dtype}
        autocast = torch_autocast.policy()
        if autocast is not None:
            kwargs["autocast"] = autocast
            if autocast.scales_loss:  # torch.amp.GradScaler's settings, as DeepSpeed's
                kwargs.update(loss_scale_window=2000, hysteresis=1, raise_error_at_min_scale=False)
        if data_types.grad_accum_dtype is not None:
            kwargs["grad_accum_dtype"] = _DTYPES[data_types.grad_accum_dtype]
        if bf16.enabled:
            kwargs["check_grad_overflow"] = bf16.check_grad_overflow
        if fp16.enabled:
            kwargs.update(
                static_loss_scale=None if fp16.loss_scale == 0 else float(fp16.loss_scale),
                initial_scale_power=fp16.initial_scale_power,
                loss_scale_window=fp16.loss_scale_window,
                hysteresis=fp16.hysteresis,
                consecutive_hysteresis=fp16.consecutive_hysteresis,
                min_loss_scale=float(fp16.min_loss_scale),
                raise_error_at_min_scale=fp16.raise_error_at_min_scale,
            )
        try:
            return cls(**kwargs)
        except ConfigError as e:
            where = _key_path(e.field)
            if where is None or e.path != f"MixedPrecision.{e.field}":
                raise
            raise ConfigError(where, f"{e.reason} ({e.path})", field=e.field) from None


def _key_path(field: str | None) -> str | None:
    """The ds_config key a `MixedPrecision` field is read from (`static_loss_scale` ->
    `fp16.loss_scale`)."""
    if field == "grad_accum_dtype":
        return "data_types.grad_accum_dtype"
    if field == "static_loss_scale":
        return "fp16.loss_scale"
    fp16 = {f.name: name for name, (f, _) in ds_keys(Fp16Config).items()}
    return f"fp16.{fp16[field]}" if field in fp16 else None


class LossScaler:
    """The fp16 loss scale `S`, raised while steps are clean and lowered on overflow.

    Rules (DeepSpeed's `DynamicLossScaler` as of 0.17.1, same knobs):

    - overflow (an inf/NaN anywhere in the gradients, agreed by every rank): the step is skipped.
      While `hysteresis` budget remains (more than 1 left), the overflow only spends one unit of
      it; otherwise the scale is halved, never below `min_loss_scale`. The budget is not
      refilled by halving.
    - an overflow at `min_loss_scale` (with no budget left) raises `FloatingPointError`,
      unless `MixedPrecision.raise_error_at_min_scale` is False (then it warns and goes on).
    - a clean step that follows `c` clean steps since the last overflow (or since the start)
      doubles the scale when `c > 0` and `c % loss_scale_window == 0`, and refills the budget.
      So after an overflow the first doubling comes at the (window + 1)-th clean step, later ones
      every `loss_scale_window` steps (DeepSpeed before 0.17.1 doubled at the window-th).
    - `consecutive_hysteresis`: every clean step refills the budget.

    For fp32/bf16 the scale is 1 and never changes. A static scale never changes either, but
    overflowing steps are still skipped.

    `checks`: whether a step's gradients are checked for inf/NaN at all, as DeepSpeed 0.19.8
    checks them (`scripts/record_ds_nan_skip.py`): fp16 always; bf16 at stages 0 and 3, and at
    stages 1-2 unless `check_grad_overflow` is False; fp32 at stages 1-3 (at stage 0 fp32
    DeepSpeed steps the bare torch optimizer, so a NaN reaches every weight there too). A
    checked step costs one read of the gradients and nothing on the wire: the flag rides in
    the optimizer's existing flags all-reduce (at stage 0 every rank holds the whole reduced
    gradient, so its own check is every rank's).
    """

    def __init__(self, precision: MixedPrecision, stage: int = 1) -> None:
        self.precision = precision
        bf16 = precision.param_dtype == torch.bfloat16
        if precision.uses_loss_scaling:
            self.checks = True
        elif bf16:
            self.checks = stage in (0, 3) or precision.check_grad_overflow
        else:
            self.checks = stage > 0
        self.dynamic = precision.uses_loss_scaling and precision.static_loss_scale is None
        if not precision.uses_loss_scaling:
            self.scale = 1.0
        elif precision.static_loss_scale is not None:
            self.scale = float(precision.static_loss_scale)
        else:
            self.scale = 2.0**precision.initial_scale_power
        self.clean_steps = 0  # consecutive steps without overflow since the last overflow
        self.hysteresis_left = precision.hysteresis
        self.overflows = 0  # total skipped steps, for logs

    def unscale(
        self,
        grads: list[torch.Tensor],
        device: torch.device,
        strategy: Any = None,
    ) -> torch.Tensor | None:
        """Divide `grads` by the scale, in place; return this rank's overflow flag (1 element,
        fp32, on `device`: 1 where any gradient holds an inf or a NaN) when the step is checked
        (`checks`), else None (nothing is read).

        `strategy`: the `ShardStrategy` whose `master_grads` `grads` are. With `grads_in_files`
        (ZeRO-Infinity) they are meta markers and the values are in swap files; their Σ g²,
        kept as they were written (`grad_square_sum`), is not finite when one of them held an
        inf or a NaN (or a value past fp32's range squared, as DeepSpeed's own test counts a
        sum past it), so the check reads no file."""
        if self.scale != 1.0:
            inv_scale = 1.0 / self.scale
            for g in grads:
                g.mul_(inv_scale)
        if not self.checks:
            return None
        # A tensor holding an inf or a NaN has a sum that is not finite (DeepSpeed's own test,
        # which also counts a finite sum past fp32's range): one scalar per tensor, where
        # `isfinite(g).any()` allocates numel bytes twice, the step's peak at a small
        # sub-group (test_subgroup_step_memory.py). On the gradients' device: no host sync.
        bad = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            if g.device.type != "meta":  # ZeRO-Infinity's markers: checked below
                torch.maximum(bad, (~torch.isfinite(g.sum(dtype=torch.float32))).float(), out=bad)
        if strategy is not None and strategy.grads_in_files:
            squares = strategy.grad_square_sum().to(device, torch.float32).reshape(1)
            torch.maximum(bad, (~torch.isfinite(squares)).float(), out=bad)
        return bad

    def skip(self, step: int) -> None:
        """Record a skipped step (`update(overflow=True)`) and log a warning naming it: `step`
        counts the boundaries, skipped ones included, as DeepSpeed's `global_steps` + 1."""
        self.update(overflow=True)
        _log.warning(
            "gradient overflow (inf/nan) in step %d: step skipped, loss scale now %g",
            step,
            self.scale,
        )

    def update(self, overflow: bool) -> None:
        """Record one optimizer step's outcome and adjust the scale.

        Raises `FloatingPointError` on an overflow at the minimum scale (see the class rules).
        """
        p = self.precision
        if overflow:
            self.overflows += 1
            self.clean_steps = 0
            if not self.dynamic:
                return
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
                return
            if self.scale <= p.min_loss_scale:
                if p.raise_error_at_min_scale:
                    raise FloatingPointError(
                        f"fp16 gradients overflowed at the minimum loss scale {self.scale:g}: "
                        f"the scale cannot go lower, so every later step would be skipped too. "
                        f"Lower MixedPrecision.min_loss_scale (ds_config fp16.min_loss_scale), "
                        f"train in bf16, or set MixedPrecision(raise_error_at_min_scale=False) "
                        f"(fp16.raise_error_at_min_scale: false) to skip the step and continue"
                    )
                _log.warning(
                    "fp16 overflow at the minimum loss scale %g; training may not recover",
                    self.scale,
                )
            self.scale = max(self.scale / 2.0, p.min_loss_scale)
            return
        if not self.dynamic:
            self.clean_steps += 1
            return
        if p.consecutive_hysteresis:
            self.hysteresis_left = p.hysteresis
        if self.clean_steps > 0 and self.clean_steps % p.loss_scale_window == 0:
            self.scale *= 2.0
            self.hysteresis_left = p.hysteresis
        self.clean_steps += 1

    def state_dict(self) -> dict[str, float | int]:
        """Everything needed to resume with the same scale schedule."""
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
            "overflows": self.overflows,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore what `state_dict` returned."""
        missing = {"scale", "clean_steps", "hysteresis_left", "overflows"} - state.keys()
        if missing:
            raise KeyError(
                f"loss scaler state lacks {sorted(missing)}; pass what LossScaler.state_dict() returned"
            )
        if not (math.isfinite(float(state["scale"])) and float(state["scale"]) > 0):
            raise ValueError(f"loss scale must be a finite positive number, got {state['scale']}")
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.overflows = int(state["overflows"])

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.scale:g}, dynamic={self.dynamic}, clean_steps={self.clean_steps})"


_log = get_logger("zero")
