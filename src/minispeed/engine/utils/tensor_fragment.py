"""DeepSpeed's `deepspeed.utils.tensor_fragment` names: one parameter's whole fp32 value,
gradient or optimizer state from the engine's sharded optimizer.

```python
from minispeed.engine.utils import safe_get_full_grad   # was: from deepspeed.utils import ...
engine.backward(loss)
for name, p in engine.module.named_parameters():        # every rank, same order: collective
    g = safe_get_full_grad(p)                           # None except at a boundary
```

Each name calls `minispeed.zero.full_values` (costs and timing rules there): the `safe_get_*`
getters are collective at ZeRO stages 1-3, the setters local. Where DeepSpeed allows the
`safe_*_local_*` names only at stage 3, here they give this rank's fragment at any stage.
Differences: `safe_get_full_grad` returns the gradient unscaled under fp16 (DeepSpeed: still
multiplied by the loss scale), and None outside the time between a window's last backward and
`step` (DeepSpeed: a partial or stale buffer at stages 1-2, the local gradient at stage 0).
`safe_set_full_grad` / `safe_set_local_grad` (and `safe_update_full_grad_vectorized` over them)
write the reduced gradient the coming `step` applies (its clipping sees it), between a window's
last backward and `step` only, unscaled as the getters give it; refused under `offload_optimizer`,
whose step reads a host copy. `safe_set_local_optimizer_state` writes this rank's fragment of a
state. Not provided: `safe_set_local_fp32_param` (a write of one rank's master fragment alone
would leave the ranks' parameters disagreeing until the next step); importing it raises an
`ImportError` naming what to use instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minispeed.engine.missing import decline
from minispeed.zero import full_values as _fv

safe_get_full_fp32_param = _fv.full_fp32_param
safe_get_full_grad = _fv.full_grad
safe_get_full_optimizer_state = _fv.full_optimizer_state
safe_get_local_fp32_param = _fv.local_fp32_param
safe_get_local_grad = _fv.local_grad
safe_get_local_optimizer_state = _fv.local_optimizer_state
safe_set_full_fp32_param = _fv.set_full_fp32_param
safe_set_full_optimizer_state = _fv.set_full_optimizer_state
safe_set_full_grad = _fv.set_full_grad
safe_set_local_grad = _fv.set_local_grad
safe_set_local_optimizer_state = _fv.set_local_optimizer_state


def safe_update_full_grad_vectorized(
    param_list: list[torch.nn.Parameter], update_func: Callable[..., torch.Tensor]
) -> None:
    """DeepSpeed's: each parameter's full gradient replaced by `update_func(grad, param)`
    (collective: every rank, the same list; parameters without a gradient are skipped).
    Cost: `safe_get_full_grad`'s all-reduce per parameter."""
    for p in param_list:
        grad = _fv.full_grad(p)
        if grad is not None:
            _fv.set_full_grad(p, update_func(grad, p))


_NOT_PROVIDED = {
    "safe_set_local_fp32_param": (
        "a write of one rank's master fragment alone would leave the ranks' parameters "
        "disagreeing until the next step (Note [a set value reaches the model now])"
    ),
}
_INSTEAD = "set whole values with safe_set_full_fp32_param (every rank, the same value)"


def __getattr__(name: str) -> object:
    if name in _NOT_PROVIDED:
        decline(
            f"deepspeed.utils.{name} is not provided by minispeed ({_NOT_PROVIDED[name]}); "
            f"{_INSTEAD}",
            name,
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]
