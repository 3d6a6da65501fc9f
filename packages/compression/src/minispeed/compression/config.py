"""DeepSpeed's `compression_training` section as frozen dataclasses (docs/packages/compression.md).

```python
from minispeed.compression import CompressionConfig
cfg = CompressionConfig.from_ds_config(ds_config["compression_training"])
cfg.techniques["weight_quantization"].groups[0].target_bits      # 8
```

The section holds one entry per technique, each with `shared_parameters` (on/off, when it
starts, the method) and `different_groups` (named groups: which modules, by regular expressions
searched in the module names, and the group's own numbers). `layer_reduction` stands apart: it
initializes a shallower student from a teacher. Everything is checked here, once: a bad key or
value is a `ConfigError` naming the key path and the fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from minispeed.core.config import ConfigError, check_keys, join_path

__all__ = ["TECHNIQUES", "CompressionConfig", "Group", "LayerReduction", "Technique"]

SECTION = "compression_training"

# DeepSpeed's techniques in its own order (the order `init_compression` applies them, and
# `redundancy_clean` fixes them in, activation quantization moved last there).
TECHNIQUES = (
    "weight_quantization",
    "activation_quantization",
    "sparse_pruning",
    "row_pruning",
    "head_pruning",
    "channel_pruning",
)
# DeepSpeed's default start step of each technique when `schedule_offset` is left out.
_OFFSET_DEFAULT = {"weight_quantization": 0}
_SHARED_KEYS = {
    "weight_quantization": {
        "enabled", "quantizer_kernel", "schedule_offset", "quantize_groups", "quantize_verbose",
        "quantization_type", "quantize_weight_in_forward", "rounding", "fp16_mixed_quantize",
    },
    "activation_quantization": {
        "enabled", "quantization_type", "range_calibration", "schedule_offset",
    },
    "sparse_pruning": {"enabled", "method", "schedule_offset", "schedule_offset_end"},
    "row_pruning": {"enabled", "method", "schedule_offset"},
    "head_pruning": {"enabled", "method", "schedule_offset", "num_heads"},
    "channel_pruning": {"enabled", "method", "schedule_offset"},
}  # fmt: skip
_GROUP_PARAMS = {
    "weight_quantization": {"start_bits", "target_bits", "quantization_period"},
    "activation_quantization": {"bits"},
    "sparse_pruning": {"dense_ratio"},
    "row_pruning": {"dense_ratio"},
    "head_pruning": {"dense_ratio"},
    "channel_pruning": {"dense_ratio"},
}


@dataclass(frozen=True)
class Group:
    """One entry of a technique's `different_groups`."""

    name: str
    """The group's name, as the config spells it (only for messages)."""
    modules: tuple[str, ...]
    """Regular expressions: a module is in the group when one is found (`re.search`) in its
    name. `"*"` alone: every compressible module."""
    related_modules: tuple[tuple[str, ...], ...] | None = None
    """Row/head/channel pruning: for each pattern of `modules`, the patterns of the layers whose
    inputs (row pruning: the next linear; channel pruning: the next batch norm and convolution)
    or heads (head pruning: Q, K, V) go with it, so `clean` removes them physically; None:
    pruned rows/heads/channels are zeroed in place only."""
    target_bits: int | None = None
    """Weight quantization: the bits of the fake-quantized weights from `schedule_offset` on;
    activation quantization: `bits`."""
    start_bits: int | None = None
    """Weight quantization: DeepSpeed requires it; its forward quantizer uses `target_bits` only
    (the step-down from `start_bits` is MoQ's, the fp16 optimizer-step mode, not provided)."""
    quantization_period: int = 1
    """Weight quantization: read and checked, unused for the same reason as `start_bits`."""
    dense_ratio: float | None = None
    """Pruning: the fraction of weights (rows, heads) kept, in (0, 1]."""


@dataclass(frozen=True)
class Technique:
    """One technique of the section: its shared parameters and its groups."""

    name: str
    """One of `TECHNIQUES`."""
    enabled: bool = False
    schedule_offset: int = 1000
    """The first optimizer step (counted from 0) at which the technique acts."""
    schedule_offset_end: int | None = None
    """Sparse pruning: the technique switches on at a step in [offset, end] and stays on, as
    DeepSpeed's scheduler; None: `schedule_offset`."""
    symmetric: bool = True
    """Quantization: `quantization_type` symmetric (True) or asymmetric."""
    quantize_groups: int = 1
    """Weight quantization: groups of the flattened weight, each with its own scale."""
    static_range: bool = False
    """Activation quantization: `range_calibration` static (a running min/max, momentum 0.95)
    instead of each token's own range (dynamic)."""
    method: str = "l1"
    """Pruning: `l1` (a fixed mask from the weights' magnitude, chosen at `init_compression`)
    or `topk` (learned scores, one per weight/row/head, trained through the mask)."""
    num_heads: int | None = None
    """Head pruning: attention heads of the output projection's input."""
    groups: tuple[Group, ...] = ()


@dataclass(frozen=True)
class LayerReduction:
    """`layer_reduction`: a student initialized from chosen layers of a teacher."""

    enabled: bool = False
    keep_number_layer: int | None = None
    """The student's layer count; must equal `len(teacher_layer)` when given."""
    module_name_prefix: str = ""
    """The layers' container (`"encoder.layer"`, `"transformer.h"`): layer i is `prefix.i`."""
    teacher_layer: tuple[int, ...] = ()
    """Student layer i takes teacher layer `teacher_layer[i]`'s parameters."""
    other_module_name: tuple[str, ...] = ()
    """Other modules copied whole (embeddings, final norm, head)."""


@dataclass(frozen=True)
class CompressionConfig:
    """The whole section: `techniques` (by name, in `TECHNIQUES` order) and `layer_reduction`."""

    techniques: Mapping[str, Technique] = field(default_factory=dict)
    layer_reduction: LayerReduction = field(default_factory=LayerReduction)

    @property
    def enabled(self) -> list[Technique]:
        """The techniques switched on, in `TECHNIQUES` order."""
        return [t for t in self.techniques.values() if t.enabled]

    @classmethod
    def from_ds_config(cls, section: Mapping[str, Any] | None) -> CompressionConfig:
        """Read DeepSpeed's `compression_training` section (None or `{}`: nothing on)."""
        section = dict(section or {})
        check_keys(section, known={*TECHNIQUES, "layer_reduction"}, path=SECTION)
        techniques = {
            name: _technique(name, section.get(name), join_path(SECTION, name))
            for name in TECHNIQUES
        }
        reduction = _layer_reduction(section.get("layer_reduction"))
        return cls(techniques, reduction)


def _mapping(value: Any, path: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"must be an object, got {type(value).__name__}")
    return dict(value)


def _int(value: Any, path: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(path, f"must be an integer >= {low}, got {value!r}")
    return value


def _choice(value: Any, path: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(path, f"must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _technique(name: str, raw: Any, path: str) -> Technique:
    raw = _mapping(raw, path)
    check_keys(raw, known={"shared_parameters", "different_groups"}, path=path)
    shared_path = join_path(path, "shared_parameters")
    shared = _mapping(raw.get("shared_parameters"), shared_path)
    check_keys(shared, known=_SHARED_KEYS[name], path=shared_path)
    at = lambda key: join_path(shared_path, key)  # noqa: E731
    enabled = shared.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(at("enabled"), f"must be true or false, got {enabled!r}")
    offset = _int(
        shared.get("schedule_offset", _OFFSET_DEFAULT.get(name, 1000)), at("schedule_offset"), 0
    )
    kwargs: dict[str, Any] = {"name": name, "enabled": enabled, "schedule_offset": offset}
    if "quantization_type" in _SHARED_KEYS[name]:
        kind = _choice(
            shared.get("quantization_type", "symmetric"),
            at("quantization_type"),
            ("symmetric", "asymmetric"),
        )
        kwargs["symmetric"] = kind == "symmetric"
    if name == "weight_quantization":
        _check_weight_modes(shared, at)
        kwargs["quantize_groups"] = _int(shared.get("quantize_groups", 1), at("quantize_groups"), 1)
    elif name == "activation_quantization":
        calibration = _choice(
            shared.get("range_calibration", "dynamic"),
            at("range_calibration"),
            ("dynamic", "static"),
        )
        kwargs["static_range"] = calibration == "static"
    else:
        methods = ("topk",) if name == "head_pruning" else ("l1", "topk")
        default = "topk" if name == "head_pruning" else "l1"
        method = shared.get("method", default)
        if method == "snip_momentum":
            raise ConfigError(
                at("method"),
                "snip_momentum needs Intel Neural Compressor's pruners, not provided; use l1 or topk",
            )
        kwargs["method"] = _choice(method, at("method"), methods)
        if name == "sparse_pruning":
            end = _int(shared.get("schedule_offset_end", offset), at("schedule_offset_end"), 0)
            if end < offset:
                raise ConfigError(
                    at("schedule_offset_end"),
                    f"must be >= schedule_offset ({offset}), got {end}: pruning switches on at a "
                    "step between the two",
                )
            kwargs["schedule_offset_end"] = end
        if name == "head_pruning" and enabled:
            if "num_heads" not in shared:
                raise ConfigError(at("num_heads"), "must be given with head pruning enabled")
            kwargs["num_heads"] = _int(shared["num_heads"], at("num_heads"), 1)
    groups_path = join_path(path, "different_groups")
    groups_raw = _mapping(raw.get("different_groups"), groups_path)
    if enabled and not groups_raw:
        raise ConfigError(groups_path, f"must name at least one group with {name} enabled")
    groups = tuple(_group(name, g, v, join_path(groups_path, g)) for g, v in groups_raw.items())
    return Technique(**kwargs, groups=groups)


def _check_weight_modes(shared: Mapping[str, Any], at: Any) -> None:
    """The weight-quantization modes DeepSpeed has and minispeed does not: refused by name."""
    if shared.get("enabled", False) and not shared.get("quantize_weight_in_forward", False):
        raise ConfigError(
            at("quantize_weight_in_forward"),
            "must be true: weights are fake-quantized in the forward (QAT); DeepSpeed's other "
            "mode (MoQ, quantizing the fp16 optimizer's weights after each step) is not provided",
        )
    if shared.get("quantizer_kernel", False):
        raise ConfigError(
            at("quantizer_kernel"),
            "must be false: the quantizer is pure PyTorch (DeepSpeed's CUDA kernel serves MoQ only)",
        )
    if shared.get("rounding", "nearest") != "nearest":
        raise ConfigError(
            at("rounding"),
            f"must be 'nearest', got {shared['rounding']!r}: the forward quantizer rounds to "
            "nearest (DeepSpeed's stochastic rounding is MoQ's)",
        )
    mixed = shared.get("fp16_mixed_quantize", {})
    if isinstance(mixed, Mapping) and mixed.get("enabled", False):
        raise ConfigError(
            at("fp16_mixed_quantize.enabled"), "must be false: MoQ's fp16 mixing is not provided"
        )


def _group(technique: str, name: str, raw: Any, path: str) -> Group:
    raw = _mapping(raw, path)
    check_keys(raw, known={"params", "modules", "related_modules"}, path=path)
    modules = raw.get("modules", ["*"])
    if isinstance(modules, str):
        modules = [modules]
    if not modules or not all(isinstance(m, str) for m in modules):
        raise ConfigError(
            join_path(path, "modules"), f"must be a list of patterns, got {modules!r}"
        )
    related = raw.get("related_modules")
    if related is not None:
        if technique not in ("row_pruning", "head_pruning", "channel_pruning"):
            raise ConfigError(
                join_path(path, "related_modules"),
                f"is for row, head and channel pruning, not {technique}",
            )
        if len(related) != len(modules) or not all(isinstance(r, list) for r in related):
            raise ConfigError(
                join_path(path, "related_modules"),
                "must hold one list of patterns per pattern of `modules`",
            )
        related = tuple(tuple(r) for r in related)
    params_path = join_path(path, "params")
    params = _mapping(raw.get("params"), params_path)
    check_keys(params, known=_GROUP_PARAMS[technique], path=params_path)
    at = lambda key: join_path(params_path, key)  # noqa: E731
    kwargs: dict[str, Any] = {}
    if technique == "weight_quantization":
        for key in ("start_bits", "target_bits"):
            if key not in params:
                raise ConfigError(at(key), "must be given for each weight quantization group")
        kwargs["target_bits"] = _int(params["target_bits"], at("target_bits"), 1)
        kwargs["start_bits"] = _int(params["start_bits"], at("start_bits"), kwargs["target_bits"])
        kwargs["quantization_period"] = _int(
            params.get("quantization_period", 1), at("quantization_period"), 1
        )
    elif technique == "activation_quantization":
        bits = params.get("bits")
        if bits not in (4, 8):
            raise ConfigError(at("bits"), f"must be 4 or 8 (DeepSpeed's choices), got {bits!r}")
        kwargs["target_bits"] = bits
    else:
        ratio = params.get("dense_ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
            raise ConfigError(
                at("dense_ratio"), f"must be a fraction in (0, 1] of what is kept, got {ratio!r}"
            )
        kwargs["dense_ratio"] = float(ratio)
    return Group(name, tuple(modules), related, **kwargs)


def _layer_reduction(raw: Any) -> LayerReduction:
    path = join_path(SECTION, "layer_reduction")
    raw = _mapping(raw, path)
    known = {f.name for f in dataclasses.fields(LayerReduction)}
    check_keys(raw, known=known, path=path)
    if not raw.get("enabled", False):
        return LayerReduction()
    teacher = raw.get("teacher_layer")
    if not isinstance(teacher, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in teacher
    ):
        raise ConfigError(
            join_path(path, "teacher_layer"), f"must be a list of layer indices, got {teacher!r}"
        )
    keep = raw.get("keep_number_layer")
    if keep is not None and keep != len(teacher):
        raise ConfigError(
            join_path(path, "keep_number_layer"),
            f"is {keep} but teacher_layer names {len(teacher)} layers: student layer i takes "
            "teacher_layer[i], so give as many as the student keeps",
        )
    prefix = raw.get("module_name_prefix")
    if not isinstance(prefix, str) or not prefix:
        raise ConfigError(
            join_path(path, "module_name_prefix"),
            "must name the layers' container (e.g. 'encoder.layer')",
        )
    others = raw.get("other_module_name", [])
    return LayerReduction(True, keep, prefix, tuple(teacher), tuple(others))
