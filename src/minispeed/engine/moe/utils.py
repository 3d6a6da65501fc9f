"""DeepSpeed's `deepspeed.moe.utils` import path (the module name is DeepSpeed's; the code lives
in `groups.py` and `registry.py`)."""

from minispeed.engine.moe.groups import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param_group,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)
from minispeed.engine.moe.registry import is_moe_param

__all__ = [
    "configure_moe_param_groups",
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]
