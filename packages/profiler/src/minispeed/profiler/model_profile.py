"""`get_model_profile`: DeepSpeed's one-call profile of a model's forward.

```python
flops, macs, params = profiler.get_model_profile(model, input_shape=(8, 3, 224, 224))
flops, macs, params = profiler.get_model_profile(
    model, args=[idx], kwargs={"labels": idx}, print_profile=False, as_string=False
)
```

The signature and the return value are DeepSpeed 0.19.8's
(`deepspeed.profiling.flops_profiler.get_model_profile`); the counts are ours, per aten
operator (see the docs page's "Differences from DeepSpeed" for where the numbers differ).
Cost: `warm_up` unprofiled forwards, then one profiled forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from minispeed.profiler.flops_profiler import FlopsProfiler
from minispeed.profiler.report import macs_to_string, number_to_string, params_to_string

__all__ = ["get_model_profile"]

_MODES = ("forward", "generate")


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: list[type] | None = None,
    mode: str = "forward",
) -> tuple[int, int, int] | tuple[str, str, str]:
    """Profile one forward of `model` (or one `model.generate` call, `mode="generate"`) and
    return `(flops, macs, params)`: numbers, or DeepSpeed's strings (`"124.56 K"`,
    `"61.06 KMACs"`, `"17.03 K"`) when `as_string`.

    The input is `input_shape` (a zero tensor of the model's dtype and device, the only
    positional argument) or `args` and `kwargs`. As DeepSpeed, the model is put in eval mode
    for the call and run `warm_up` times unprofiled first; unlike DeepSpeed, its training mode
    is restored afterwards. `print_profile` prints the summary and the module table
    (`module_depth`, `top_modules`, `detailed`) to stdout or `output_file`; modules of the
    types in `ignore_modules` get no row (their work is their caller's).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile profiles an nn.Module, got {type(model).__name__}")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    args = list(args or [])
    kwargs = dict(kwargs or {})
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or len(input_shape) < 1:
            raise TypeError(
                f"input_shape must be a non-empty tuple of sizes, got {input_shape!r}; "
                "pass the inputs themselves as args=[...] / kwargs={...} instead"
            )
        param = next(model.parameters(), None)
        like = {"dtype": param.dtype, "device": param.device} if param is not None else {}
        args = [torch.zeros(input_shape, **like)]
    if not args and not kwargs:
        raise ValueError("get_model_profile needs input_shape, or args and/or kwargs")
    if warm_up < 0:
        raise ValueError(f"warm_up must be >= 0, got {warm_up}")
    run = model.generate if mode == "generate" else model
    was_training = model.training
    model.eval()
    try:
        for _ in range(warm_up):
            run(*args, **kwargs)
        prof = FlopsProfiler(model)
        prof.start_profile(ignore_list=ignore_modules)
        try:
            run(*args, **kwargs)
        finally:
            prof.stop_profile()
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(
                profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                detailed=detailed, output_file=output_file,
            )  # fmt: skip
        prof.end_profile()
    finally:
        model.train(was_training)
    if as_string:
        return (
            number_to_string(flops),
            macs_to_string(macs),
            params_to_string(params),
        )
    return flops, macs, params
