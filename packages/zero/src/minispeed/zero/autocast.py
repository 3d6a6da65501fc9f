"""torch.autocast training: fp32 parameters, a 16-bit forward, some gradients sent in 16 bits.

The third way to train in 16 bits (beside bf16 and fp16 parameters, precision.py), DeepSpeed's
`torch_autocast` section. The parameters, their gradients, the masters and the optimizer stay
fp32; only the forward runs under `torch.autocast(device_type, dtype)`, which casts the inputs of
matrix products and convolutions to `dtype` and keeps reductions such as softmax and norms in
fp32. Autograd casts each gradient back to its parameter's fp32.

What travels: the gradients of the parameters owned directly by a *lower-precision-safe* module
(`Autocast.safe_modules`, by exact class: `nn.Linear` and `nn.Conv1d/2d/3d` unless the config
names others) are reduced in `dtype` at ZeRO stages 1-3, as DeepSpeed 0.19.8's ZeRO optimizers
reduce them; every other gradient is reduced in fp32. At stage 0 DeepSpeed all-reduces every
gradient in fp32, and so do we. Stage 3 all-gathers the parameters in fp32 here (DeepSpeed also
gathers the safe ones in `dtype`; see docs/packages/zero.md).

Bytes on the wire per reduction, Ψ_s = elements of the safe parameters, Ψ_o = the others, N
ranks, reduce-scatter: (N-1)/N · (2·Ψ_s + 4·Ψ_o), against (N-1)/N · 4·(Ψ_s + Ψ_o) without
autocast: the safe parameters' share is halved (`wire_bytes`). The safe and the other
parameters never share a bucket (`FlatLayout`'s `wire_dtypes`, stage 3's bucket plan), so each
bucket is one collective in one dtype; a 16-bit bucket is cast from the fp32 gradient buffer
before its collective and cast back after it: one more buffer of the bucket's size in `dtype`
while it is in flight (Note [a 16-bit bucket on the wire] in reducer.py). Bytes kept are fp32 training's (4 per parameter, 4 per gradient, the optimizer's).

fp16 autocast needs a loss scale (fp16's range, precision.py): the optimizer's `LossScaler`
with `torch.amp.GradScaler`'s settings (first scale 2^16, halved on an overflow, doubled after
2,000 clean steps), as DeepSpeed uses a GradScaler there.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from minispeed.core.sections import Section, key

__all__ = [
    "Autocast",
    "TorchAutocastConfig",
    "autocast_region",
    "marked_wire_dtype",
    "wire_bytes",
    "wire_dtype_of",
]

# DeepSpeed's default lower-precision-safe classes (its LOWER_PRECISION_SAFE_MODULES).
DEFAULT_SAFE_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "torch.float32": torch.float32,
}


def class_name(cls: type) -> str:
    """`nn.Linear` -> `"torch.nn.modules.linear.Linear"` (the config's spelling)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _read_dtype(value: Any) -> str | None:
    if value is None or value in _DTYPES:
        return value
    raise ValueError(
        f"{value!r} is not a dtype autocast runs in; use bfloat16, float16 (or fp32: autocast "
        "off in effect)"
    )


def _read_names(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise TypeError(f'must be a list of class paths such as ["torch.nn.Linear"], got {value!r}')
    for name in value:
        if "." not in name:
            raise ValueError(
                f"{name!r} is not a class path: write the module and the class "
                '("torch.nn.Linear", "my_model.MyLinear")'
            )
    return tuple(value)


@dataclass(frozen=True)
class TorchAutocastConfig(Section):
    """Forward under torch.autocast with fp32 parameters (DeepSpeed section `torch_autocast`)."""

    ds_path: ClassVar[str] = "torch_autocast"

    enabled: bool = key("enabled", False)
    """Run the engine's forward under `torch.autocast` (`minispeed.zero.Autocast`)."""
    dtype: str | None = key("dtype", None, read=_read_dtype, schema={"enum": [*_DTYPES, None]})
    """The forward's lower dtype (bfloat16 or float16); left out: the device's autocast default
    (bf16 on the CPU, fp16 on CUDA), and every gradient then travels in fp32, as in DeepSpeed."""
    lower_precision_safe_modules: tuple[str, ...] | None = key(
        "lower_precision_safe_modules",
        None,
        read=_read_names,
        schema={"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
    )
    """Module classes (`"torch.nn.Linear"`) whose own parameters' gradients are reduced in
    `dtype` at ZeRO stages 1-3, matched by exact class; left out: Linear and Conv1d/2d/3d."""

    @staticmethod
    def torch_dtype(name: str) -> torch.dtype:
        """A `dtype` value as a torch dtype (`"bfloat16"` -> `torch.bfloat16`)."""
        return _DTYPES[name]

    def policy(self) -> Autocast | None:
        """The `Autocast` this section asks for (None when not enabled); a class path that does
        not import is a `ConfigError` naming the key."""
        from minispeed.core.config import ConfigError

        if not self.enabled:
            return None
        if self.lower_precision_safe_modules is None:
            return Autocast(_DTYPES.get(self.dtype), DEFAULT_SAFE_MODULES)
        classes = []
        for name in self.lower_precision_safe_modules:
            module, _, attr = name.rpartition(".")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ConfigError(
                    f"{self.ds_path}.lower_precision_safe_modules",
                    f"{name!r} does not import ({e}); name a module class by its import path, "
                    'such as "torch.nn.Linear"',
                ) from None
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise ConfigError(
                    f"{self.ds_path}.lower_precision_safe_modules",
                    f"{name!r} is not an nn.Module class; name module classes only",
                )
            classes.append(cls)
        return Autocast(_DTYPES.get(self.dtype), tuple(classes))


@dataclass(frozen=True)
class Autocast:
    """The forward under `torch.autocast(device_type, dtype)`; the gradients of the parameters
    owned by a module of a class in `safe_modules` reduced in `dtype` at ZeRO stages 1-3."""

    dtype: torch.dtype | None = torch.bfloat16
    """The forward's lower dtype; None: the device's autocast default, gradients in fp32."""
    safe_modules: tuple[type[nn.Module], ...] = DEFAULT_SAFE_MODULES
    """Classes (exact match, not subclasses) whose own parameters' gradients travel in `dtype`."""

    def __post_init__(self) -> None:
        if self.dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(
                f"Autocast.dtype must be torch.bfloat16, torch.float16 or None, got {self.dtype}"
            )

    @property
    def wire_dtype(self) -> torch.dtype:
        """What the safe parameters' gradients travel in (fp32 when `dtype` is None)."""
        return self.dtype or torch.float32

    @property
    def scales_loss(self) -> bool:
        """fp16 needs a loss scale (module docstring)."""
        return self.dtype == torch.float16

    def wire_dtypes(self, model: nn.Module) -> dict[nn.Parameter, torch.dtype]:
        """`{parameter: dtype its gradient travels in}` for the parameters of the safe modules
        (exact class, each module's own parameters); the others are not in it (fp32)."""
        out: dict[nn.Parameter, torch.dtype] = {}
        for module in model.modules():
            if type(module) in self.safe_modules:
                for p in module.parameters(recurse=False):
                    out[p] = self.wire_dtype
        return out

    def mark(self, model: nn.Module) -> None:
        """Remember `wire_dtypes(model)` for `wire_dtype_of` (DeepSpeed's `comm_dtype` mark on
        each safe parameter, kept here in a weak registry instead of on the parameter); called
        once by `zero.shard`."""
        _MARKED.update(self.wire_dtypes(model))

    def safe_module_names(self) -> list[str]:
        """The safe classes as the config names them (`"torch.nn.modules.linear.Linear"`)."""
        return [class_name(c) for c in self.safe_modules]


# Each safe parameter's wire dtype, from `Autocast.mark`; weak: the parameter's lifetime (by
# identity: weakref.WeakKeyDictionary compares tensors with ==).
_MARKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def wire_dtype_of(param: nn.Parameter) -> torch.dtype | None:
    """The dtype `zero.shard` reduces `param`'s gradient in under autocast at ZeRO stages 1-3,
    or None: not a safe module's parameter (its gradient travels in the gradients' dtype)."""
    return _MARKED.get(param)


def marked_wire_dtype() -> torch.dtype | None:
    """The wire dtype of some parameter `Autocast.mark` registered (None: none is alive)."""
    return next(iter(_MARKED.values()), None)


@contextlib.contextmanager
def autocast_region(autocast: Autocast | None, device_type: str) -> Iterator[None]:
    """The engine's forward region, as DeepSpeed's: under `autocast` when given (replacing an
    autocast the caller opened), and with autocast switched *off* when not given but the caller
    opened one (the engine's own mixed precision, bf16/fp16 sections, decides then)."""
    if autocast is not None:
        with torch.autocast(device_type=device_type, dtype=autocast.dtype, enabled=True):
            yield
    elif torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    else:
        yield


def wire_bytes(numels: Sequence[int], dtypes: Sequence[torch.dtype], world_size: int) -> int:
    """Bytes one rank sends reduce-scattering gradients of `numels` elements travelling in
    `dtypes` over `world_size` ranks (ring): Σ (N-1)/N · numel · itemsize."""
    n = world_size
    return sum((n - 1) * numel * d.itemsize // n for numel, d in zip(numels, dtypes))
