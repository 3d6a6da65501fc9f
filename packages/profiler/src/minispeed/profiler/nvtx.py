"""Named ranges for Nsight Systems and torch.profiler: `range`, and one range per module call.

```python
from minispeed import profiler

with profiler.range("train.step"):          # also @profiler.range("train.step")
    with profiler.module_ranges(model, depth=2):
        loss = model(x, y)[1]               # ranges "model", "model.blocks.0", ...
```

`range` is `minispeed.core.ranges.range`, the primitive every minispeed package marks its phases
with (`comm.*`, `zero*.*`): an NVTX push/pop while a tool listens (`nsys profile` sets
`NVTX_INJECTION64_PATH`; `MINISPEED_NVTX=1` forces it) and a `torch.profiler.record_function`
while a profiler records; free otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from minispeed.core.ranges import NVTX_DOMAIN, enable_nvtx, nvtx_enabled, range

__all__ = ["NVTX_DOMAIN", "enable_nvtx", "module_ranges", "nvtx_enabled", "range"]


@contextlib.contextmanager
def module_ranges(model: nn.Module, depth: int = 1, prefix: str = "model") -> Iterator[None]:
    """Open a range around every forward call of `model`'s modules down to `depth` levels
    below it (0: the model alone; -1: every module), named `prefix.<qualified name>`.

    Forward only: a module's backward runs inside autograd's engine, whose order NVTX ranges
    (strictly nested per thread) cannot follow; the `comm.*`/`zero*` ranges and the
    `torch.profiler` backward operators mark that part of a timeline. Costs two hooks per
    module call; the hooks are removed on exit.
    """
    if depth < -1:
        raise ValueError(f"module_ranges depth must be -1 (all) or >= 0, got {depth}")
    handles: list[Any] = []
    open_ranges: list[range] = []  # a stack: forward calls nest

    def pre(name: str):
        def hook(module: nn.Module, args: Any) -> None:
            r = range(name)
            r.__enter__()
            open_ranges.append(r)

        return hook

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if open_ranges:
            open_ranges.pop().__exit__(None, None, None)

    for qualified, module in model.named_modules():
        level = qualified.count(".") + 1 if qualified else 0
        if depth != -1 and level > depth:
            continue
        name = f"{prefix}.{qualified}" if qualified else prefix
        handles.append(module.register_forward_pre_hook(pre(name), prepend=True))
        handles.append(module.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
