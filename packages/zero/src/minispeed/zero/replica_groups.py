"""Param groups with their own process group: where their copies live (expert parallelism).

```python
opt = zero.shard(model, torch.optim.AdamW(groups), config=zero.ZeroConfig(stage=2),
                 replica_groups=[None, expert_data_group])   # one entry per param group
```

Note [replica groups]
By default every rank of the data-parallel group `group` holds a copy of every parameter. With
expert parallelism that is false for the experts: a rank holds only the experts of its expert
rank, and the ranks holding the *same* experts form its expert-data group. `replica_groups[g]`
names, for param group g, the process group of the ranks holding copies of this rank's
parameters of that group (`None`: `group`). Then, for that param group:

- stage 0 all-reduces its gradients over its replica group, stages 1-2 reduce-scatter them and
  partition its masters and optimizer state over it (Ψ_g·(4 + K)/|replica group| bytes per rank);
- the reduced sum is divided by the size of `group`, not of the replica group, as DeepSpeed does:
  the loss is the mean over the data-parallel ranks, and an expert's gradient on one rank already
  sums the contributions of every rank of its expert group (they arrived through the
  all-to-all), so the expert-data sum covers all of them (minispeed.moe's
  Note [expert gradient scale]);
- the parameters start equal within the replica group (broadcast from its first rank), not
  over `group`, where they differ.

Clipping: the global norm counts every parameter once. Summed over the ranks of `group`, a
partitioned shard is held once, but a stage-0 replica `|replica group|` times; so each rank adds
its squares weighted by 1/|replica group| at stage 0 (1 at stages 1-2) and one all-reduce over
`group` sums them (`grad_square_sum`). That assumes what expert parallelism gives: ranks in
different replica groups hold different parameters, so the replica groups of a param group tile
`group`. Overflow and unused parameters are agreed over `group` as before (any rank's overflow
skips the step everywhere).

Implementation: one stage strategy per distinct replica group, each over its own param groups,
seen by `ZeroOptimizer` as one strategy (`ReplicaGroupedStrategy`). Stage 3 and offload refuse
replica groups (not implemented). Costs per step: the stage's, per replica group, with its size
in place of N; one collective launch queue per replica group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import ParamFragment, ShardStrategy
from minispeed.zero.precision import MixedPrecision

__all__ = [
    "ReplicaGroupedStrategy",
    "broadcast_within",
    "check_replica_groups",
    "make_stage_strategy",
]


def check_replica_groups(
    replica_groups: Sequence[Any], num_param_groups: int, config: ZeroConfig
) -> None:
    """Refuse what replica groups do not support, naming the fix (local, every rank alike)."""
    if len(replica_groups) != num_param_groups:
        raise ValueError(
            f"replica_groups has {len(replica_groups)} entries but the optimizer has "
            f"{num_param_groups} param groups; give one per param group (None: the data group)"
        )
    if config.stage == 3:
        raise NotImplementedError(
            "replica_groups (param groups with their own process group, e.g. MoE experts) are "
            "implemented for ZeRO stages 0-2; use stage 2, or drop the per-group process groups"
        )
    if config.offload_optimizer is not None or config.offload_param is not None:
        raise NotImplementedError(
            "replica_groups with offload_optimizer/offload_param is not implemented; remove the "
            "offload section or the per-group process groups"
        )


class ReplicaGroupedStrategy(ShardStrategy):
    """One stage strategy per distinct replica group, seen as one (Note [replica groups]).

    `make(param_groups, group, grad_divisor)` builds the stage's strategy over a subset of the
    param groups; this object maps the global param-group indices onto them.
    """

    partitions_grads = True  # the norm is summed over `group` from weighted squares

    def __init__(
        self,
        make: Callable[..., Any],
        param_groups: Sequence[Sequence[nn.Parameter]],
        replica_groups: Sequence[Any],
        group: Any,
        config: ZeroConfig,
    ) -> None:
        self.config = config
        divisor = comm.get_world_size(group)
        # parts[j]: (global param-group indices, the strategy over them, its replica count).
        self.parts: list[tuple[list[int], Any, int]] = []
        self._process_group: dict[int, Any] = {}  # param-group index -> its replica group
        for key, indices in _by_replica_group(replica_groups, group):
            strategy = make([param_groups[g] for g in indices], key, divisor)
            replicas = comm.get_world_size(key) if config.stage == 0 else 1
            self.parts.append((indices, strategy, replicas))
            self._process_group.update(dict.fromkeys(indices, key))
        self.num_groups = len(param_groups)

    def process_group_of(self, param_group: int) -> Any:
        """The process group param group `param_group` is reduced and partitioned over."""
        return self._process_group[param_group]

    def _by_group(self, per_part: Callable[[Any], list[Any]]) -> list[Any]:
        out: list[Any] = [None] * self.num_groups
        for indices, strategy, _ in self.parts:
            for g, value in zip(indices, per_part(strategy)):
                out[g] = value
        return out

    def master_params(self) -> list[list[torch.Tensor]]:
        """Per param group (global order), its strategy's masters."""
        return self._by_group(lambda s: s.master_params())

    def master_grads(self) -> list[list[torch.Tensor]]:
        """Per param group (global order), its strategy's reduced fp32 gradients."""
        return self._by_group(lambda s: s.master_grads())

    def grad_square_sum(self) -> torch.Tensor:
        """This rank's share of the squared global norm: Σ g² / replicas per part (fp32, (1,)).
        `ZeroOptimizer._clip` all-reduces it over the data group. Note [replica groups]."""
        total = None
        for _, strategy, replicas in self.parts:
            for gs in strategy.master_grads():
                for g in gs:
                    sq = g.float().pow(2).sum() / replicas
                    total = sq if total is None else total + sq
        return total.reshape(1) if total is not None else torch.zeros(1)

    def backward_begins(self, is_boundary: bool) -> None:
        """Each replica group's strategy learns whether this backward ends the window."""
        for _, strategy, _ in self.parts:
            strategy.backward_begins(is_boundary)

    def backward_done(self, is_boundary: bool) -> None:
        """Each replica group's reductions (each in its own launch order)."""
        for _, strategy, _ in self.parts:
            strategy.backward_done(is_boundary)

    def publish_params(self) -> None:
        """Each strategy publishes its masters (stages 1-2: all-gathers over its replica group)."""
        for _, strategy, _ in self.parts:
            strategy.publish_params()

    def zero_grad(self) -> None:
        """Clear every part's gradients."""
        for _, strategy, _ in self.parts:
            strategy.zero_grad()

    def fragments(self) -> list[ParamFragment]:
        """Every part's fragments, with their param-group index made global."""
        out = []
        for indices, strategy, _ in self.parts:
            out += [dataclasses.replace(f, group=indices[f.group]) for f in strategy.fragments()]
        return sorted(out, key=lambda f: (f.group, f.master_index))

    def close(self) -> None:
        """Close every part (idempotent, local)."""
        for _, strategy, _ in self.parts:
            strategy.close()

    def bucket_numels(self) -> list[int]:
        """Every part's reduce calls, part after part (each in its own group)."""
        return [n for _, strategy, _ in self.parts for n in strategy.bucket_numels()]


@torch.no_grad()
def broadcast_within(
    param_groups: Sequence[Sequence[nn.Parameter]],
    replica_groups: Sequence[Any],
    group: Any,
    broadcast: Callable[[list[list[nn.Parameter]], Any], None],
) -> None:
    """Start each param group equal over its replica group (from the group's first rank), with
    `broadcast(param_groups, process_group)`: Ψ_g·bytes sent once per param group."""
    for key, indices in _by_replica_group(replica_groups, group):
        broadcast([list(param_groups[g]) for g in indices], key)


def _by_replica_group(replica_groups: Sequence[Any], group: Any) -> list[tuple[Any, list[int]]]:
    """(process group, the param-group indices reduced over it), in first-use order (`None` is
    `group`). Process groups compare by identity; every rank lists its param groups in the same
    order, so every rank issues each replica group's collectives in the same order."""
    out: list[tuple[Any, list[int]]] = []
    for g, rg in enumerate(replica_groups):
        rg = group if rg is None else rg
        for key, indices in out:
            if key is rg:
                indices.append(g)
                break
        else:
            out.append((rg, [g]))
    return out


def make_stage_strategy(
    strategy_class: type,
    model: nn.Module,
    config: ZeroConfig,
    precision: MixedPrecision,
) -> Callable[..., Any]:
    """`make(param_groups, group, grad_divisor)` for `ReplicaGroupedStrategy`."""

    def make(param_groups: list[list[nn.Parameter]], group: Any, grad_divisor: int) -> Any:
        return strategy_class(
            model, config, precision, group, param_groups=param_groups, grad_divisor=grad_divisor
        )

    return make
