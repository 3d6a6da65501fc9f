"""`deepspeed.runtime.torch_autocast`: DeepSpeed's helpers of the `torch_autocast` section.

Pure adapters over `minispeed.zero.autocast`, where the logic is: which classes are lower-precision
safe by default, the dtype a parameter's gradient travels in (DeepSpeed marks the parameter with
a `comm_dtype` attribute; minispeed keeps a weak registry that `zero.shard` fills), and the
engine's forward region. `init_autocast_params` is DeepSpeed's engine-internal set-up; the
engine does it at `initialize` from the config, so it is not offered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from minispeed.zero.autocast import Autocast, autocast_region, marked_wire_dtype, wire_dtype_of

__all__ = [
    "autocast_if_enabled",
    "get_all_comm_dtypes",
    "get_autocast_dtype",
    "get_comm_dtype",
    "get_default_autocast_lower_precision_modules",
    "has_comm_dtype",
    "is_autocast_initialized",
    "sort_dtypes",
]


def get_default_autocast_lower_precision_modules() -> list[str]:
    """`["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d", ...]`."""
    return Autocast().safe_module_names()


def has_comm_dtype(param: torch.nn.Parameter) -> bool:
    """Whether `param` belongs to a lower-precision-safe module of an engine under autocast."""
    return wire_dtype_of(param) is not None


def get_comm_dtype(param: torch.nn.Parameter) -> torch.dtype:
    """The dtype `param`'s gradient is reduced in at ZeRO stages 1-3 (its own dtype unless it
    belongs to a lower-precision-safe module)."""
    return wire_dtype_of(param) or param.dtype


def get_all_comm_dtypes(params: Iterable[torch.nn.Parameter]) -> set[torch.dtype]:
    return {get_comm_dtype(p) for p in params}


def sort_dtypes(dtypes: Iterable[torch.dtype]) -> list[torch.dtype]:
    """DeepSpeed's fixed order of dtypes (by name): the order its buckets of each are reduced."""
    return sorted(dtypes, key=str)


def is_autocast_initialized() -> bool:
    """Whether an engine set up with `torch_autocast` (and its model) is alive."""
    return marked_wire_dtype() is not None


def get_autocast_dtype() -> torch.dtype | None:
    """The dtype such an engine's safe gradients travel in (None: no such engine)."""
    return marked_wire_dtype()


@contextlib.contextmanager
def autocast_if_enabled(engine: Any) -> Iterator[None]:
    """The engine's forward region: its `torch_autocast`, or an outer autocast switched off."""
    with autocast_region(engine.config.precision.autocast, engine.device.type):
        yield
