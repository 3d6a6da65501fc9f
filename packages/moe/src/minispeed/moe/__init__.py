"""minispeed.moe: mixture-of-experts layers with expert parallelism over minispeed.comm.

Reading order (see README.md):

1. `config` — `MoEConfig` and `from_section` (DeepSpeed's MoE arguments).
2. `costs` — capacity and all-to-all bytes, written once.
3. `gating` — `TopKGate` and the `Routing` it returns (counts, drops, aux loss, z-loss).
4. `dispatch_einsum` — the dense one-hot formulation (the readable reference).
5. `dispatch` and `permute` — the same movement as index plans and a gather/combine op.
6. `groups` and `exchange` — expert-parallel groups and the all-to-alls.
7. `experts`, `layer` — the `MoE` module and `replace_mlp`, the engine's entry point.
8. `grads`, `checkpoint` — gradient averaging and expert-once checkpoints.
"""

from minispeed.moe.checkpoint import load_checkpoint, save_checkpoint
from minispeed.moe.config import MoEConfig
from minispeed.moe.costs import all_to_all_bytes, capacity
from minispeed.moe.dispatch import DispatchPlan, plan_dispatch
from minispeed.moe.experts import Experts
from minispeed.moe.gating import Routing, TopKGate, load_balancing_loss, router_z_loss
from minispeed.moe.grads import dense_parameters, expert_parameters, reduce_gradients
from minispeed.moe.groups import ExpertGroups
from minispeed.moe.layer import MoE, aux_loss, groups_of, moe_layers, replace_mlp

__all__ = [
    "DispatchPlan",
    "ExpertGroups",
    "Experts",
    "MoE",
    "MoEConfig",
    "Routing",
    "TopKGate",
    "all_to_all_bytes",
    "aux_loss",
    "capacity",
    "dense_parameters",
    "expert_parameters",
    "groups_of",
    "load_balancing_loss",
    "load_checkpoint",
    "moe_layers",
    "plan_dispatch",
    "reduce_gradients",
    "replace_mlp",
    "router_z_loss",
    "save_checkpoint",
]
