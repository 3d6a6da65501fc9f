"""DeepSpeed's `deepspeed.accelerator` import path: `get_accelerator()` with DeepSpeed's method
names, over `minispeed.core.accelerator`.

```python
from minispeed.engine.accelerator import get_accelerator  # was: deepspeed.accelerator
device = torch.device(get_accelerator().device_name(local_rank))   # "cuda:0", or "cpu"
get_accelerator().manual_seed_all(1234)
```

DeepSpeed's accelerator names differ from core's (`device_name` / `current_device_name` /
`communication_backend_name` / `current_device` where core has `device` /
`communication_backend` / `current_device_index`); this wrapper answers DeepSpeed's names, as
DeepSpeed 0.19.8's CPU accelerator does on the CPU (`device_name(i)` is `"cpu"` there), and
passes every other attribute to core's accelerator. On the CPU, `device_count()` is the number
of processes on this node, as DeepSpeed's CPU accelerator answers under its own launcher
(`LOCAL_SIZE`), so a DeepSpeed-style `world_size <= device_count()` guard holds: minispeed reads
`LOCAL_SIZE`, then torchrun's `LOCAL_WORLD_SIZE`, else 1 (DeepSpeed, without `LOCAL_SIZE`,
counts the NUMA nodes). `is_current_accelerator_supported()` is true of every device minispeed
runs on. Costs: one Python call.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from minispeed.core.accelerator import Accelerator
from minispeed.core.accelerator import get_accelerator as _core_accelerator

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "is_current_accelerator_supported"]


class DeepSpeedAccelerator:
    """DeepSpeed's accelerator interface over a core `Accelerator`."""

    def __init__(self, accelerator: Accelerator) -> None:
        self._acc = accelerator

    def _on_cpu(self) -> bool:
        return self._acc.device().type == "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        """`"cpu"`, or `"cuda"` / `"cuda:<index>"` (DeepSpeed's strings)."""
        kind = self._acc.device().type
        return kind if device_index is None or kind == "cpu" else f"{kind}:{device_index}"

    def current_device_name(self) -> str:
        return self.device_name(None if self._on_cpu() else self._acc.current_device_index())

    def device_count(self) -> int:
        """The devices of this node; on the CPU, the processes of this node (module docstring)."""
        if not self._on_cpu():
            return self._acc.device_count()
        return int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)

    def current_device(self) -> int:
        return self._acc.current_device_index()

    def device(self, device_index: int | None = None) -> torch.device:
        return self._acc.device(device_index)

    def communication_backend_name(self) -> str:
        return self._acc.communication_backend()

    def is_synchronized_device(self) -> bool:
        """True on the CPU, where kernels run eagerly (DeepSpeed's meaning)."""
        return self._on_cpu()

    def use_host_timers(self) -> bool:
        return self._on_cpu()

    def manual_seed(self, seed: int) -> None:
        if self._on_cpu():
            torch.manual_seed(seed)
        else:
            torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._on_cpu():
            torch.manual_seed(seed)
        else:
            torch.cuda.manual_seed_all(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._acc, name)


def get_accelerator() -> DeepSpeedAccelerator:
    """The current accelerator (core's choice: CUDA when available, `MINISPEED_ACCELERATOR`)."""
    return DeepSpeedAccelerator(_core_accelerator())


def is_current_accelerator_supported() -> bool:
    """Whether the current device is one minispeed runs on: always, since core chose it."""
    return get_accelerator()._acc.is_available()
