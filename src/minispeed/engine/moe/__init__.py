"""DeepSpeed's `deepspeed.moe` import paths: `layer.MoE` and
`utils.split_params_into_different_moe_groups_for_optimizer`, over `minispeed.moe`."""

from minispeed.engine.moe.groups import split_params_into_different_moe_groups_for_optimizer
from minispeed.engine.moe.layer import MoE

__all__ = ["MoE", "split_params_into_different_moe_groups_for_optimizer"]
