"""Applying a `CompressionConfig` to a model: `compress`, the `Schedule` that switches each
technique on, `clean`, and `init_student` (docs/packages/compression.md).

```python
from minispeed import compression
cfg = compression.CompressionConfig.from_ds_config(ds["compression_training"])
model = compression.compress(model, cfg)          # the chosen nn.Linear -> CompressedLinear
schedule = compression.Schedule(model, cfg)       # step 0's techniques on now
for batch in data:
    ...; optimizer.step(); schedule.step()        # one call per applied optimizer step
model = compression.clean(model, cfg)             # masks applied, pruned rows/heads removed
```

Module selection, as DeepSpeed's: a group's pattern takes every compressible module whose name
it is found in (`re.search`); a module taken twice by one technique is an error. `nn.Linear`
layers take every technique but channel pruning, `nn.Embedding` tables weight quantization,
`nn.Conv2d` channel pruning; other modules DeepSpeed would take for a technique (a convolution
for quantization or sparse pruning, an embedding for pruning) are left as they are, with one
warning naming them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from minispeed.compression.config import CompressionConfig, Group, LayerReduction, Technique
from minispeed.compression.layer import (
    CompressedConv2d,
    CompressedEmbedding,
    CompressedLinear,
    keep_channels,
)
from minispeed.core.logging import get_logger

__all__ = ["Schedule", "clean", "compress", "init_student"]

_log = get_logger("compression")
_OTHER_COMPRESSIBLE = (nn.Embedding, nn.Conv2d, nn.BatchNorm2d)
# The order `clean` makes techniques permanent in (DeepSpeed's redundancy_clean order):
# quantize the weights first, then apply the masks over them.
_CLEAN_ORDER = (
    "weight_quantization", "sparse_pruning", "row_pruning", "head_pruning", "channel_pruning",
)  # fmt: skip
# The module types each technique takes (`_KINDS`), and those its related_modules may be.
_KINDS: dict[str, tuple[type, ...]] = {
    "weight_quantization": (nn.Linear, nn.Embedding),
    "channel_pruning": (nn.Conv2d,),
}
_RELATED_KINDS: dict[str, tuple[type, ...]] = {"channel_pruning": (nn.Conv2d, nn.BatchNorm2d)}


def _find(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _matches(
    model: nn.Module,
    pattern: str,
    taken: set[str] | None,
    where: str,
    kinds: tuple[type, ...] = (nn.Linear,),
) -> list[str]:
    """Names of the modules of `kinds` `pattern` is found in (`"*"`: all), in module order; a
    name already in `taken` is an error (None: no check)."""
    names, skipped = [], []
    for name, module in model.named_modules():
        if not name or (pattern != "*" and re.search(pattern, name) is None):
            continue
        if isinstance(module, _OTHER_COMPRESSIBLE) and not isinstance(module, kinds):
            skipped.append(f"{name} ({type(module).__name__})")
        if not isinstance(module, kinds):
            continue
        if taken is not None:
            if name in taken:
                raise ValueError(
                    f"{where}: module {name!r} is already taken by another pattern of this "
                    "technique; narrow the patterns so each module is in one group"
                )
            taken.add(name)
        names.append(name)
    if skipped:
        _log.warning(
            "%s: pattern %r also matches %s, left uncompressed by this technique "
            "(minispeed.compression: docs/packages/compression.md)",
            where, pattern, ", ".join(skipped),
        )  # fmt: skip
    return names


def _group_layers(model: nn.Module, technique: Technique) -> Iterator[tuple[Group, int, list[str]]]:
    """(group, pattern index, matched names) for every pattern of every group of `technique`."""
    taken: set[str] = set()
    kinds = _KINDS.get(technique.name, (nn.Linear,))
    for group in technique.groups:
        where = f"{technique.name}.different_groups.{group.name}"
        for i, pattern in enumerate(group.modules):
            yield group, i, _matches(model, pattern, taken, where, kinds)


def _layers(
    model: nn.Module, technique: Technique
) -> Iterator[tuple[Group, CompressedLinear | CompressedEmbedding | CompressedConv2d]]:
    for group, _, names in _group_layers(model, technique):
        for name in names:
            layer = _find(model, name)
            if not isinstance(layer, CompressedLinear | CompressedEmbedding | CompressedConv2d):
                raise ValueError(
                    f"{technique.name} selects {name!r}, which is not compressed: call "
                    "init_compression(model, ds_config) (minispeed.compression.compress) before "
                    "deepspeed.initialize, with the same compression_training section"
                )
            yield group, layer


def _unwrap(model: nn.Module) -> nn.Module:
    """An engine's module (DeepSpeed's functions take either)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def compress(
    model: nn.Module, config: CompressionConfig, teacher: nn.Module | None = None
) -> nn.Module:
    """Replace the `nn.Linear` layers the enabled techniques select with `CompressedLinear`
    (sharing their tensors) and attach each technique, switched off until `Schedule` turns it
    on. With `layer_reduction` enabled, first initialize the model from `teacher`
    (`init_student`). Returns `model`, changed in place.
    """
    target = _unwrap(model)
    if config.layer_reduction.enabled:
        if teacher is None:
            raise ValueError(
                "layer_reduction is enabled: pass the teacher model (teacher_model=...) to "
                "initialize the student from"
            )
        init_student(target, teacher, config.layer_reduction)
    for technique in config.enabled:
        for group, _, names in _group_layers(target, technique):
            for name in names:
                layer = _find(target, name)
                if isinstance(layer, nn.Embedding) and not isinstance(layer, CompressedEmbedding):
                    layer = CompressedEmbedding.wrap(layer)
                    _replace(target, name, layer)
                elif isinstance(layer, nn.Conv2d) and not isinstance(layer, CompressedConv2d):
                    layer = CompressedConv2d.wrap(layer)
                    _replace(target, name, layer)
                elif isinstance(layer, nn.Linear) and not isinstance(layer, CompressedLinear):
                    layer = CompressedLinear.wrap(layer)
                    _replace(target, name, layer)
                _attach(layer, technique, group, name)
    return model


def _attach(
    layer: CompressedLinear | CompressedEmbedding | CompressedConv2d,
    technique: Technique,
    group: Group,
    name: str,
) -> None:
    try:
        if isinstance(layer, CompressedConv2d):
            assert technique.name == "channel_pruning" and group.dense_ratio is not None
            layer.enable_channel_pruning(group.dense_ratio, technique.method)
            return
        if technique.name == "weight_quantization":
            assert group.target_bits is not None
            layer.enable_weight_quantization(
                group.target_bits, technique.quantize_groups, technique.symmetric
            )
        elif isinstance(layer, CompressedEmbedding):
            raise AssertionError(f"{technique.name} does not select embeddings")
        elif technique.name == "activation_quantization":
            assert group.target_bits is not None
            layer.enable_activation_quantization(
                group.target_bits, technique.symmetric, technique.static_range
            )
        elif technique.name == "sparse_pruning":
            assert group.dense_ratio is not None
            layer.enable_sparse_pruning(group.dense_ratio, technique.method)
        elif technique.name == "row_pruning":
            assert group.dense_ratio is not None
            layer.enable_row_pruning(group.dense_ratio, technique.method)
        elif technique.name == "head_pruning":
            assert group.dense_ratio is not None and technique.num_heads is not None
            layer.enable_head_pruning(group.dense_ratio, technique.num_heads)
    except ValueError as e:
        raise ValueError(f"{technique.name} of {name!r} (group {group.name!r}): {e}") from None


class Schedule:
    """Switches each enabled technique on at its `schedule_offset` (counted in applied
    optimizer steps from 0), as DeepSpeed's compression scheduler: built, it applies step 0;
    `step()` after every applied optimizer step advances one. Once on, a technique stays on.

    The engine holds one when the config's section enables a technique (`on_boundary`, told
    of every accumulation boundary, steps it when the optimizer step was applied).
    """

    def __init__(self, model: nn.Module, config: CompressionConfig) -> None:
        self.model = _unwrap(model)
        self.config = config
        self.steps = 0
        self._layers = {
            t.name: [layer for _, layer in _layers(self.model, t)] for t in config.enabled
        }
        if config.enabled and not any(self._layers.values()):
            raise ValueError(
                "compression_training enables "
                + ", ".join(t.name for t in config.enabled)
                + " but its modules patterns match no nn.Linear of the model: check them "
                "against the names of model.named_modules()"
            )
        self._apply()

    def step(self) -> None:
        """One applied optimizer step more; switch on what starts now."""
        self.steps += 1
        self._apply()

    def on_boundary(self, engine: object) -> None:
        """The engine's step observer: the count becomes the engine's applied optimizer steps
        (`global_steps - skipped_steps`: an fp16 overflow's skipped step does not count, as
        DeepSpeed's), so a resumed engine's schedule catches up at its first boundary."""
        applied = engine.global_steps - engine.skipped_steps  # type: ignore[attr-defined]
        if applied != self.steps:
            self.steps = applied
            self._apply()

    def active(self, technique: Technique) -> bool:
        """Whether `technique` is on at `self.steps` (sparse pruning: switched on at a step in
        [offset, offset_end], staying on)."""
        if technique.name == "sparse_pruning":
            assert technique.schedule_offset_end is not None
            return self.steps >= technique.schedule_offset and (
                technique.schedule_offset <= technique.schedule_offset_end
            )
        return self.steps >= technique.schedule_offset

    def _apply(self) -> None:
        for technique in self.config.enabled:
            if not self.active(technique):
                continue
            for layer in self._layers[technique.name]:
                if technique.name == "weight_quantization":
                    layer.weight_active = True
                elif technique.name == "activation_quantization":
                    layer.activation_active = True
                else:
                    prune = getattr(layer, technique.name.removesuffix("_pruning"))
                    if prune is not None:
                        prune.active = True


def clean(model: nn.Module, config: CompressionConfig) -> nn.Module:
    """Make the techniques permanent (DeepSpeed's `redundancy_clean`): weights quantized to
    their grid, masks multiplied in, and, where a row/head group names `related_modules`, the
    pruned output rows (and the next layer's matching inputs) or heads (and Q/K/V's matching
    output rows) removed, so the model is physically smaller. Returns `model`, changed in place;
    build the optimizer after it (the shrunk layers hold new parameters).

    Saved: per pruned row of a (out, in) layer followed by a (next_out, out) layer,
    `(in + 1 + next_out)` parameters; per pruned head of dimension d with Q, K, V of width
    `in`, `d·(3·in + 3 + out)` parameters; and every mask and score tensor.
    """
    target = _unwrap(model)
    released = [
        n for n, p in target.named_parameters() if p.numel() and not p.untyped_storage().size()
    ]
    if released:
        raise ValueError(
            f"parameters {released[:3]} hold no storage (ZeRO stage 3 partitions them): clean "
            "the consolidated model instead (engine.save_16bit_model, or `minispeed consolidate` "
            "of a checkpoint, loaded into the compressed model)"
        )
    enabled = {t.name: t for t in config.enabled}
    for name in _CLEAN_ORDER:
        technique = enabled.get(name)
        if technique is None:
            continue
        for group, i, names in _group_layers(target, technique):
            related = None if group.related_modules is None else group.related_modules[i]
            keeps = []
            for layer_name in names:
                layer = _find(target, layer_name)
                if name == "weight_quantization" and isinstance(layer, CompressedEmbedding):
                    layer.fix_weight_quantization()
                    continue
                if isinstance(layer, CompressedConv2d):
                    keeps.append(layer.fix_channel_pruning(shrink=related is not None))
                    continue
                assert isinstance(layer, CompressedLinear), f"{layer_name} was not compressed"
                keeps.append(_fix(layer, name, shrink=related is not None))
            for pattern in related or ():
                where = f"{name}.different_groups.{group.name}.related_modules"
                kinds = _RELATED_KINDS.get(name, (nn.Linear,))
                for j, other_name in enumerate(_matches(target, pattern, None, where, kinds)):
                    if j >= len(keeps):
                        raise ValueError(
                            f"{where}: pattern {pattern!r} matches more layers than "
                            f"{group.modules[i]!r} ({len(keeps)}); pair them one to one"
                        )
                    keep = keeps[j]
                    assert keep is not None
                    other = _find(target, other_name)
                    if name == "channel_pruning":
                        keep_channels(other, keep)
                        continue
                    if not isinstance(other, CompressedLinear):
                        other = CompressedLinear.wrap(other)
                        _replace(target, other_name, other)
                    if name == "row_pruning":
                        other.keep_inputs(keep)
                    else:
                        assert technique.num_heads is not None
                        other.keep_heads(keep, technique.num_heads)
    return model


def _fix(layer: CompressedLinear, technique: str, shrink: bool) -> torch.Tensor | None:
    if technique == "weight_quantization":
        layer.fix_weight_quantization()
        return None
    if technique == "sparse_pruning":
        layer.fix_sparse_pruning()
        return None
    if technique == "row_pruning":
        return layer.fix_row_pruning(shrink)
    return layer.fix_head_pruning(shrink)


@torch.no_grad()
def init_student(student: nn.Module, teacher: nn.Module, reduction: LayerReduction) -> None:
    """Copy teacher layer `teacher_layer[i]` into student layer i (`module_name_prefix.i`), and
    each of `other_module_name` whole (DeepSpeed's layer reduction, as in XTC's 6-layer and
    TinyBERT-style students). Parameters pair up in order; their shapes must agree."""
    pairs = [
        (f"{reduction.module_name_prefix}.{i}", f"{reduction.module_name_prefix}.{t}")
        for i, t in enumerate(reduction.teacher_layer)
    ] + [(name, name) for name in reduction.other_module_name]
    for student_name, teacher_name in pairs:
        s_params = list(student.get_submodule(student_name).parameters())
        t_params = list(teacher.get_submodule(teacher_name).parameters())
        if [p.shape for p in s_params] != [p.shape for p in t_params]:
            raise ValueError(
                f"layer_reduction: student {student_name!r} and teacher {teacher_name!r} have "
                "different parameter shapes; the student must be the teacher's architecture "
                "with fewer layers"
            )
        for s, t in zip(s_params, t_params, strict=True):
            s.copy_(t)
