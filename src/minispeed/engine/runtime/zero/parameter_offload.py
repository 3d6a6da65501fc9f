"""`deepspeed.runtime.zero.parameter_offload`: `DeepSpeedZeRoOffload`, the object DeepSpeed's
ZeRO-3 optimizer keeps as `parameter_offload`, as its clients reach it.

TRL's online trainers (GRPO, RLOO, GKD, online DPO) generate under ZeRO-3 inside
`GatheredParameters(model.parameters())` and, around `generate`, strip the module hooks through
this object (`forward_hooks`, `backward_hooks`, `param_coordinator`, each parameter's
`ds_active_sub_modules`), then put them back with `_register_deepspeed_module(module)`, so that
no module fetches or releases per token.

minispeed's stage-3 hooks already fetch nothing while `GatheredParameters` holds every
parameter (a held parameter is never released: `ShardedParam.holds`), so there is nothing to
strip: the hook lists are empty, putting them back is a no-op, and the coordinator's trace is
reported invalid, so nothing is invalidated. What remains per module and token is the hooks'
bookkeeping (a dict lookup and a count each).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["DeepSpeedZeRoOffload"]


class _Coordinator:
    """DeepSpeed's `PartitionedParameterCoordinator` as TRL asks it: its trace is invalid (no
    recorded order to invalidate)."""

    def is_invalid_trace(self) -> bool:
        return True

    def _invalidate_trace(self) -> None:
        """Nothing to invalidate."""


class _Root:
    """The model as DeepSpeed's offload object holds it: its parameters, and none external (a
    parameter used by a module that does not own it is still owned, so named, in the tree)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[Any]:
        return self._module.named_parameters(prefix=prefix, recurse=recurse)

    def ds_external_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return []


class DeepSpeedZeRoOffload:
    """The ZeRO-3 optimizer's `parameter_offload` (module docstring): empty hook lists, a
    no-op `_register_deepspeed_module`, an invalid trace."""

    def __init__(self, module: nn.Module) -> None:
        self.module = _Root(module)
        self.forward_hooks: list[Any] = []
        self.backward_hooks: list[Any] = []
        self.param_coordinator = _Coordinator()

    def _register_deepspeed_module(self, module: Any) -> None:
        """The hooks were never removed (module docstring)."""
