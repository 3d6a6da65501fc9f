"""The engine's MoE step: which process group each optimizer param group is reduced over.

DeepSpeed's engine reduces a parameter marked `allreduce=False` (an expert) over the
expert-data group of its `group_name`, divided by the data-parallel size, and its ZeRO-1/2
optimizer partitions a param group marked `moe=True` over that expert-data group. minispeed's
`MoE` adapter records its expert parameters in `registry.py` instead of marking them; this module
reads that record and gives `zero.shard` one replica group per param group (Note [replica
groups] in minispeed.zero's replica_groups.py): the expert-data group of the param group's
experts, or `None` (the data group) for dense parameters.

Checked locally on every rank before any collective: a param group mixing experts with dense
parameters (or experts of different expert groups) cannot be reduced over one group, and is an
error naming the fix (`split_params_into_different_moe_groups_for_optimizer`), as DeepSpeed
asserts under ZeRO.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from minispeed.engine.moe.layer import MoE
from minispeed.engine.moe.registry import expert_group_name, is_moe_param

__all__ = ["expert_replica_groups"]


def expert_replica_groups(
    model: nn.Module, param_groups: Sequence[dict[str, Any]]
) -> list[Any] | None:
    """Per param group, the expert-data process group of its experts (`None`: dense); `None`
    overall when the model has no `MoE` layer."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return None
    # Layers of one group name have equal expert-data groups (same ranks): the first one serves.
    by_name: dict[str, Any] = {}
    for layer in layers:
        by_name.setdefault(layer.expert_group_name, layer.deepspeed_moe.groups.expert_data_group)
    replica_groups: list[Any] = []
    for g, group in enumerate(param_groups):
        names = {expert_group_name(p) if is_moe_param(p) else None for p in group["params"]}
        if len(names) > 1:
            kinds = sorted(n or "dense" for n in names)
            raise ValueError(
                f"optimizer param group {g} holds parameters of {kinds}: expert parameters are "
                "reduced over their expert-data group and dense ones over the data group, so "
                "each group must hold one kind. Build the groups with minispeed.engine.moe.utils."
                "split_params_into_different_moe_groups_for_optimizer (as DeepSpeed requires)"
            )
        name = next(iter(names), None)
        replica_groups.append(None if name is None else by_name[name])
    return replica_groups
