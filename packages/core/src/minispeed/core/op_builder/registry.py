"""Every op builder of every installed minispeed package, found through entry points.

A package declares its builders in its `pyproject.toml`; the entry name is the op name and the
value the builder class:

```toml
[project.entry-points."minispeed.ops"]
quantize = "minispeed.comm.compression.ops:QuantizeBuilder"
```

so a separately installed package's ops appear in `python -m minispeed.core.report` without
core knowing about it. Core's own builders are also listed here directly, so they show up even in
an editable install whose entry-point metadata predates them. `register_builder` adds a
builder for this process only (tests, notebooks).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata

from minispeed.core.op_builder.builder import OpBuilder

__all__ = ["ENTRY_POINT_GROUP", "OpRegistry", "discover_builders", "register_builder"]

ENTRY_POINT_GROUP = "minispeed.ops"

# "module:Class" of core's builders (also declared as entry points in packages/core/pyproject.toml).
_CORE_BUILDERS = (
    ("cast", "minispeed.core.ops.cast:CastBuilder"),
    ("cast_cuda", "minispeed.core.ops.cast:CastCudaBuilder"),
)

_registered: dict[str, type[OpBuilder]] = {}


@dataclasses.dataclass(frozen=True)
class OpRegistry:
    """Result of `discover_builders`: builders by op name, and entries that failed to load."""

    builders: dict[str, type[OpBuilder]]
    errors: dict[str, str]  # op name -> why its entry point could not be loaded


def register_builder(cls: type[OpBuilder]) -> type[OpBuilder]:
    """Register `cls` for this process (usable as a class decorator). Returns `cls`."""
    if not (isinstance(cls, type) and issubclass(cls, OpBuilder)) or not cls.name:
        raise TypeError(f"{cls!r} is not an OpBuilder subclass with a `name`")
    other = _registered.get(cls.name)
    if other is not None and other is not cls:
        raise ValueError(
            f"op name {cls.name!r} is already registered by {other.__module__}.{other.__qualname__}; "
            "op names must be unique across minispeed packages"
        )
    _registered[cls.name] = cls
    return cls


def _load_target(target: str) -> object:
    module_name, _, attr = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def discover_builders() -> OpRegistry:
    """Core's builders, every `minispeed.ops` entry point, then `register_builder` ones."""
    targets = dict(_CORE_BUILDERS)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        targets[ep.name] = ep.value
    builders: dict[str, type[OpBuilder]] = {}
    errors: dict[str, str] = {}
    for name, target in targets.items():
        try:
            cls = _load_target(target)
        except Exception as err:
            errors[name] = f"cannot import {target}: {type(err).__name__}: {err}"
            continue
        if not (isinstance(cls, type) and issubclass(cls, OpBuilder)):
            errors[name] = f"{target} is not an OpBuilder subclass"
        elif cls.name != name:
            errors[name] = f"{target} declares name {cls.name!r}; the entry point must be named so"
        else:
            builders[name] = cls
    builders.update(_registered)
    return OpRegistry(dict(sorted(builders.items())), errors)
