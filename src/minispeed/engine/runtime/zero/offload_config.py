"""`deepspeed.runtime.zero.offload_config`: DeepSpeed's offload config models over minispeed's
offload sections.

```python
from minispeed.engine.runtime.zero.offload_config import OffloadDeviceEnum  # was: deepspeed....
cfg = DeepSpeedZeroOffloadParamConfig(device="cpu")
cfg.device == OffloadDeviceEnum.cpu, cfg.buffer_size            # DeepSpeed's field names
```

`DeepSpeedZeroOffloadParamConfig(**section)` and `DeepSpeedZeroOffloadOptimizerConfig(**section)`
check the section with `minispeed.offload`'s `OffloadParamConfig.from_section` /
`OffloadOptimizerConfig.from_section` (the one key checker: an unknown key is a `ConfigError`
naming it) and answer each key by DeepSpeed's field name with the value minispeed applies
(`device` an `OffloadDeviceEnum`). Where minispeed's default is not DeepSpeed's, the value is
minispeed's: `pin_memory` is `False` unless written out, `max_in_cpu` is `None` (no cap) unless
written out. DeepSpeed's fields minispeed does not read (`super_offload`, `cpuadam_cores_perc`)
raise an `AttributeError` saying so. `minispeed` attribute: the package's own section object.
Cost: the section's checks.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from minispeed.core.sections import ds_keys, unsupported_keys

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
    "ds_fields",
]


class OffloadDeviceEnum(enum.StrEnum):
    """DeepSpeed's offload devices (`none`, `cpu`, `nvme`)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(enum.StrEnum):
    """The kinds of training state `engine.offload_states(include=...)` moves to the host
    (`minispeed.zero.parking`'s table)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def ds_fields(section: Any, renamed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`{DeepSpeed field name: value}` of a minispeed section object: every key it reads (by
    `renamed`'s name where DeepSpeed's field is not the key), then the keys it accepts at
    DeepSpeed's default only (their `ds_only` value)."""
    renamed = renamed or {}
    out = {
        renamed.get(k, k): getattr(section, f.name) for k, (f, _) in ds_keys(type(section)).items()
    }
    for k, entry in unsupported_keys(type(section)).items():
        if not entry.refused:
            out.setdefault(renamed.get(k, k), entry.accepted)
    return out


class _Model:
    """DeepSpeed's config model names over a minispeed section (module docstring)."""

    def __init__(self, section: Any, fields: dict[str, Any]) -> None:
        self.minispeed = section
        self._fields = fields
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"{type(self).__name__}.{name}: minispeed does not read this DeepSpeed field; the "
            f"ones it reads are {', '.join(self._fields)} (docs/engine/config-reference.md)"
        )

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._fields.items())
        return f"{type(self).__name__}({inner})"


def _offload(section: Any) -> dict[str, Any]:
    fields = ds_fields(section)
    fields["device"] = OffloadDeviceEnum(fields["device"])
    return fields


class DeepSpeedZeroOffloadParamConfig(_Model):
    """DeepSpeed's `offload_param` model: `minispeed.offload.OffloadParamConfig`."""

    def __init__(self, **section: Any) -> None:
        from minispeed.offload.config import OffloadParamConfig

        cfg = OffloadParamConfig.from_section(section)
        super().__init__(cfg, _offload(cfg))


class DeepSpeedZeroOffloadOptimizerConfig(_Model):
    """DeepSpeed's `offload_optimizer` model: `minispeed.offload.OffloadOptimizerConfig`."""

    def __init__(self, **section: Any) -> None:
        from minispeed.offload.config import OffloadOptimizerConfig

        cfg = OffloadOptimizerConfig.from_section(section)
        super().__init__(cfg, _offload(cfg))
