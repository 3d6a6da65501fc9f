"""`deepspeed.compression.helper`: `recursive_getattr` / `recursive_setattr` (a dotted module
name read or replaced), which DeepSpeed-Chat imports from here."""

from __future__ import annotations

from torch import nn

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: nn.Module, module_name: str) -> nn.Module:
    """The submodule named `module_name` (`"encoder.layer.0"`)."""
    return model.get_submodule(module_name)


def recursive_setattr(model: nn.Module, module_name: str, module: nn.Module) -> None:
    """Replace the submodule named `module_name` by `module`."""
    parent, _, child = module_name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
