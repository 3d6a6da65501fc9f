"""`deepspeed.utils.init_on_device`: `OnDevice(dtype, device="meta", enabled=True)`, a context in
which modules are built on `device` with floating-point tensors in `dtype`.

```python
from minispeed.engine.utils import OnDevice           # was: deepspeed.OnDevice
with OnDevice(dtype=torch.float16, device="meta"):    # shapes only, no memory
    model = MyModel()
```

Over torch's own device context (`torch.device` as a context manager) and default dtype, both
restored on exit; `dtype=None` keeps the default dtype. DeepSpeed also casts tensors created with
an explicit floating-point dtype to `dtype`; here an explicit dtype is kept. Cost: none beyond
the construction itself.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["OnDevice"]


class OnDevice:
    """Build modules on `device`, floating-point tensors in `dtype` (module docstring)."""

    def __init__(self, dtype: torch.dtype | None, device: Any = "meta", enabled: bool = True):
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._stack.enter_context(torch.device(self.device))
            if self.dtype is not None:
                previous = torch.get_default_dtype()
                torch.set_default_dtype(self.dtype)
                self._stack.callback(torch.set_default_dtype, previous)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()
