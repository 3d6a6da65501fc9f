"""DeepSpeed's `deepspeed.moe.utils` import path (the module name is DeepSpeed's; the code lives
in `groups.py` and `registry.py`)."""

from minispeed.engine.moe.groups import (
    is_moe_param_group,
    split_params_into_different_moe_groups_for_optimizer,
)
from minispeed.engine.moe.registry import is_moe_param

__all__ = [
    "is_moe_param",
    "is_moe_param_group",
    "split_params_into_different_moe_groups_for_optimizer",
]
