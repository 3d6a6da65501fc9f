"""DeepSpeed's `deepspeed.moe` import paths: `layer.MoE`,
`utils.split_params_into_different_moe_groups_for_optimizer` and `sharded_moe`'s gating
functions, over `minispeed.moe`."""

from minispeed.engine.moe import sharded_moe
from minispeed.engine.moe.groups import split_params_into_different_moe_groups_for_optimizer
from minispeed.engine.moe.layer import MoE

__all__ = ["MoE", "sharded_moe", "split_params_into_different_moe_groups_for_optimizer"]
