"""`deepspeed.runtime.utils`: the helpers scripts import from it.

- `move_to_device(item, device, criterion_func=None)`: every tensor inside `item` (nested lists,
  tuples, dicts) on `device`; tensors for which `criterion_func` is true are moved in place
  (their storage replaced, the object kept), as DeepSpeed's. Non-tensor leaves are returned as
  they are (DeepSpeed calls `.to` on them and fails).
- `see_memory_usage(message, force=False)`: with `force`, rank 0 prints `message` and the
  accelerator's allocated and peak bytes (on the CPU: the process's resident and peak resident
  memory); without it, nothing, as DeepSpeed. (DeepSpeed also prints the host's used memory.)
- `partition_uniform(num_items, num_parts)`, `partition_balanced(weights, num_parts)`:
  DeepSpeed's pipeline cut arithmetic (`minispeed.engine.pipe.partition`).

Cost: a walk over `item`; `see_memory_usage` a garbage collection and two reads of /proc.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

import minispeed.comm as comm
from minispeed.core.accelerator import get_accelerator
from minispeed.core.nested import map_tensors
from minispeed.engine.pipe.partition import partition_balanced, partition_uniform

__all__ = ["move_to_device", "partition_balanced", "partition_uniform", "see_memory_usage"]

_GIB = 1024**3


def move_to_device(
    item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None
) -> Any:
    """`item` with its tensors on `device` (module docstring)."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if criterion_func is not None and criterion_func(t):
            t.data = t.to(device).data
            return t
        return t.to(device)

    return map_tensors(item, move)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print `message` with the memory in use, on rank 0, when `force` (module docstring)."""
    if not force or (comm.is_initialized() and comm.get_rank() != 0):
        return
    gc.collect()
    acc = get_accelerator()
    print(message)
    print(
        f"MA {acc.memory_allocated() / _GIB:.2f} GB  "
        f"Max_MA {acc.max_memory_allocated() / _GIB:.2f} GB"
    )
    acc.reset_peak_memory_stats()
