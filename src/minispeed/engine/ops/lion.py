"""`deepspeed.ops.lion`: `DeepSpeedCPULion` with DeepSpeed's signature and defaults (betas
(0.9, 0.999)), over `minispeed.offload.CPULion`. Refused: `fp32_optimizer_states=False`.
Costs: offload's CPU Lion step."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from minispeed.engine.ops.adam import _refuse
from minispeed.offload import CPULion

__all__ = ["DeepSpeedCPULion"]


class DeepSpeedCPULion(CPULion):
    """DeepSpeed's `DeepSpeedCPULion`: `minispeed.offload.CPULion`."""

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ) -> None:
        _refuse(
            "fp32_optimizer_states", fp32_optimizer_states, True, "the momentum is kept in fp32"
        )
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
