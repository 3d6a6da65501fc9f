"""DeepSpeed's `deepspeed.ops.adam`: `FusedAdam` and `DeepSpeedCPUAdam` with DeepSpeed's
signatures, over torch's Adam and `minispeed.offload.CPUAdam`.

```python
from minispeed.engine.ops.adam import DeepSpeedCPUAdam, FusedAdam  # was: deepspeed.ops.adam
optimizer = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)  # AdamW by default
```

The same classes the config's `"optimizer": {"type": "Adam"}` builds (`engine/optim.py`):
`FusedAdam(adam_w_mode=True)` steps as `torch.optim.AdamW`, `adam_w_mode=False` as
`torch.optim.Adam` (L2 weight decay), with DeepSpeed's defaults (`weight_decay=0`); costs are
torch's (its foreach kernels, no fused DeepSpeed kernel). `DeepSpeedCPUAdam` is offload's
SIMD CPU Adam. Refused, with the reason: `bias_correction=False`, `amsgrad=True` (DeepSpeed's
fused kernels have no AMSGrad either), `set_grad_none=False`, `fp32_optimizer_states=False`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from minispeed.offload import CPUAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _refuse(name: str, value: Any, wanted: Any, why: str) -> None:
    if value != wanted:
        raise ValueError(f"{name}={value!r} is not supported ({why}); leave it {wanted!r}")


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's `FusedAdam`: torch's Adam, with decoupled weight decay when `adam_w_mode`."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
    ) -> None:
        _refuse("bias_correction", bias_correction, True, "torch's Adam always corrects the bias")
        _refuse("amsgrad", amsgrad, False, "DeepSpeed's FusedAdam has no AMSGrad")
        _refuse("set_grad_none", set_grad_none, True, "zero_grad() always sets gradients to None")
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=adam_w_mode,
        )


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's `DeepSpeedCPUAdam`: `minispeed.offload.CPUAdam` with DeepSpeed's signature
    and default, AdamW (`adamw_mode=True`: decoupled weight decay) unless `adamw_mode=False`
    (where `CPUAdam`, named after `torch.optim.Adam`, defaults to Adam's L2 decay)."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _refuse("amsgrad", amsgrad, False, "DeepSpeed's CPU Adam has no AMSGrad")
        _refuse(
            "fp32_optimizer_states", fp32_optimizer_states, True, "the moments are kept in fp32"
        )
        super().__init__(
            model_params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=adamw_mode,
            bias_correction=bias_correction,
        )
