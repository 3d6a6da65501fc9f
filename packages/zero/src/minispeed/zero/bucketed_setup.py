"""How `zero.shard` builds stages 0-2: the first rank's weights, replica groups, 1-bit Adam.

`zero.shard` (api.py) checks its inputs and picks the stage; for stages 0-2 it calls
`bucketed_strategy`, which makes every rank start from the weights of its group's first rank,
frozen ones included (stage 3 does the same per parameter as it partitions: Note [partitioning
starts from the first rank's values] in stage3/params.py), then builds `ReplicatedStrategy`
(stage 0) or `PartitionedStrategy` (stages 1-2), one per replica group when there are several
(Note [replica groups] in replica_groups.py). A 1-bit optimizer is checked first
(`check_onebit`) and, once the stage is built, becomes `onebit_parts`: its own optimizer over the
stage.

Costs: one broadcast of every parameter, frozen ones too (Ψ·p bytes), and one 1-element
all-reduce, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.comm.optim import CompressedMomentumOptimizer
from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import ShardStrategy
from minispeed.zero.model_parallel import ModelParallel
from minispeed.zero.optimizer import ZeroOptimizer
from minispeed.zero.precision import MixedPrecision
from minispeed.zero.replica_groups import (
    ReplicaGroupedStrategy,
    broadcast_within,
    make_stage_strategy,
)
from minispeed.zero.stage0 import ReplicatedStrategy
from minispeed.zero.stage12 import PartitionedStrategy

__all__ = ["bucketed_strategy", "check_onebit", "onebit_parts"]

# Note [1-bit Adam under zero]
# A 1-bit optimizer averages gradients and momenta inside its own step(), so it cannot be zero's
# inner optimizer as it is (at stage 0 it stepped nothing: the masters do not require grad; at
# stages 1-2 it averaged different ranks' shards together). `onebit.py` runs its two phases
# over the stage instead: Adam with ZeRO for the warm-up, then local gradients, a full momentum
# averaged in 1 bit, and each rank stepping its shard.


def bucketed_strategy(
    model: nn.Module,
    config: ZeroConfig,
    precision: MixedPrecision,
    group: Any,
    param_groups: list[list[nn.Parameter]],
    replica_groups: Sequence[Any] | None,
) -> ShardStrategy:
    """Stage 0 or 1-2 over `param_groups`, every rank starting from its group's first rank."""
    kind = ReplicatedStrategy if config.stage == 0 else PartitionedStrategy
    if replica_groups is None:
        # The frozen parameters too (a diffusion script's text encoder, built unseeded on each
        # rank), as DeepSpeed broadcasts every parameter of the module at `initialize`.
        broadcast_from_first_rank([*param_groups, frozen_parameters(model, param_groups)], group)
        return kind(model, config, precision, group, param_groups=param_groups)
    # See Note [replica groups]: checked by zero.shard (check_replica_groups) already. Frozen
    # parameters are the caller's here: zero cannot tell an expert's replica group from a shared
    # one's (the engine broadcasts them: broadcast_frozen in minispeed.engine's experts.py).
    broadcast_within(param_groups, replica_groups, group, broadcast_from_first_rank)
    return ReplicaGroupedStrategy(
        make_stage_strategy(kind, model, config, precision),
        param_groups,
        replica_groups,
        group,
        config,
    )


def check_onebit(
    optimizer: CompressedMomentumOptimizer,
    config: ZeroConfig,
    precision: MixedPrecision,
    *,
    model_parallel: ModelParallel | None,
    replica_groups: Sequence[Any] | None,
) -> None:
    """Refuse what zero's 1-bit path does not implement (onebit.py; Note [1-bit Adam under
    zero]). Local: every rank checks the same arguments, before any collective."""
    from minispeed.zero import onebit  # the compressed all-reduce only when asked for

    onebit.check_onebit(
        optimizer, config, precision, model_parallel=model_parallel, replica_groups=replica_groups
    )


def onebit_parts(
    optimizer: Any, strategy: ShardStrategy, group: Any
) -> tuple[type[ZeroOptimizer], dict[str, Any], torch.optim.Optimizer, ShardStrategy]:
    """What `zero.shard` wraps for a 1-bit optimizer: (optimizer class, its extra arguments,
    the warm-up's inner Adam, the stage wrapped to go local at the freeze)."""
    from minispeed.zero import onebit

    return (
        onebit.OnebitZeroOptimizer,
        {"freeze_step": optimizer.freeze_step},
        onebit.warmup_adam(optimizer),
        onebit.OnebitStrategy(strategy, group),
    )


def frozen_parameters(
    model: nn.Module, param_groups: list[list[nn.Parameter]]
) -> list[nn.Parameter]:
    """The model's parameters in no param group (frozen, or left out of the optimizer)."""
    trained = {id(p) for ps in param_groups for p in ps}
    return [p for p in model.parameters() if id(p) not in trained]


@torch.no_grad()
def broadcast_from_first_rank(param_groups: list[list[nn.Parameter]], group: Any) -> None:
    """Make every rank start from the weights of the group's first rank (Ψ·bytes sent, once)."""
    if comm.get_world_size(group) == 1:
        return
    # broadcast() takes a *global* source rank; find the global rank of group rank 0.
    device = param_groups[0][0].device if param_groups and param_groups[0] else torch.device("cpu")
    first = torch.tensor(
        [float(comm.get_rank() if comm.get_rank(group) == 0 else -1)], device=device
    )
    comm.all_reduce(first, op=comm.ReduceOp.MAX, group=group)
    src = int(first.item())
    for ps in param_groups:
        for p in ps:
            if p.data.is_contiguous():
                comm.broadcast(p.data, src=src, group=group)
            else:  # collectives need contiguous memory
                buf = p.data.contiguous()
                comm.broadcast(buf, src=src, group=group)
                p.data.copy_(buf)
