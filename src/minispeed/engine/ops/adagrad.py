"""`deepspeed.ops.adagrad`: `DeepSpeedCPUAdagrad` with DeepSpeed's signature and defaults, over
`minispeed.offload.CPUAdagrad` (the optimizer accelerate swaps in for `torch.optim.Adagrad` under
ZeRO-Offload). Refused, with the reason: `amsgrad=True` (Adagrad has none),
`fp32_optimizer_states=False`. Costs: offload's CPU Adagrad step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from minispeed.engine.ops.adam import _refuse
from minispeed.offload import CPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(CPUAdagrad):
    """DeepSpeed's `DeepSpeedCPUAdagrad`: `minispeed.offload.CPUAdagrad`."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _refuse("amsgrad", amsgrad, False, "Adagrad has no AMSGrad variant")
        _refuse("fp32_optimizer_states", fp32_optimizer_states, True, "the state is kept in fp32")
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
