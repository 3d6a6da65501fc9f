"""`map_tensors`: apply a function to every tensor inside nested lists, tuples and dicts.

```python
from minispeed.core.nested import map_tensors
on_cpu = map_tensors(state_dict, lambda t: t.detach().to("cpu"))   # same structure, new tensors
```

The containers are rebuilt with their own types (a `dict` subclass such as `OrderedDict`, a
named tuple); anything that is neither a tensor nor one of those containers is returned as it
is. Used where a structure of tensors changes device or is copied for saving (the DeepSpeed
adapters' `move_to_device` and `clone_tensors_for_torch_save`). Cost: one call of `fn` per
tensor, plus rebuilding each container.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["map_tensors"]


def map_tensors(item: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`item` with every tensor `t` inside it replaced by `fn(t)` (module docstring)."""
    if isinstance(item, torch.Tensor):
        return fn(item)
    if isinstance(item, dict):
        return type(item)((k, map_tensors(v, fn)) for k, v in item.items())
    if isinstance(item, tuple):
        mapped = [map_tensors(v, fn) for v in item]
        return type(item)(*mapped) if hasattr(item, "_fields") else type(item)(mapped)
    if isinstance(item, list):
        return [map_tensors(v, fn) for v in item]
    return item
