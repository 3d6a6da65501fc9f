"""MiCS: ZeRO-3 sharded inside groups of S ranks, replicated across the N/S groups.

```python
opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                 config=zero.ZeroConfig(stage=3, mics_shard_size=2))   # 4 ranks: 2 groups of 2
```

The N data-parallel ranks are cut into R = N/S *shard groups* of S consecutive ranks (with S the
ranks of a node, a shard group is a node); the ranks at the same position in every shard group
form a *replica group* (R ranks, one per shard group). Stage 3 runs unchanged over the shard
group: parameters, gradients and optimizer states are partitioned over its S ranks, every
parameter all-gather and gradient reduce-scatter stays inside it, and each shard is held by the R
ranks of its replica group. Only gradients cross groups:

```text
N = 4, S = 2, R = 2 (2 "nodes" x 2):   shard groups [0 1] [2 3]   replica groups [0 2] [1 3]
backward, per bucket of c columns:
  hop 1: reduce-scatter inside the shard group (S ranks)    -> my row: Σ over my group
  hop 2: all-reduce of that row over my replica group (R)   -> Σ over all N ranks
  then divided by N (R here, S by the reducer): the mean over every rank, as plain ZeRO-3
```

Costs per rank (Ψ parameters, p / g bytes per parameter / gradient element on the wire, K bytes
of optimizer state per element, ``s = ceil(n/S)`` per parameter of n elements):

| | plain ZeRO-3 over N | MiCS (S × R) |
|---|---|---|
| model states kept | ``Ψ/N·(p + 4 + g + K)`` | ``Ψ/S·(p + 4 + g + K)`` |
| parameter all-gather (forward, again in backward) | ``N·ceil(n/N)·p`` on N ranks | ``S·s·p`` on the shard group |
| gradient reduce-scatter, per bucket | ``N·c·g`` on N ranks | ``S·c·g`` on the shard group |
| gradient all-reduce, per bucket | none | ``c·g`` on the replica group (R ranks) |

(Messages in the comms logger's convention: an all-gather counts its output, a reduce-scatter
its input, an all-reduce its tensor; ``ledger.mics_step_bytes`` sums them, the tests compare the
logger with it.) A ring sends ``(S-1)/S`` of an intra-group message per rank and ``2(R-1)/R`` of
an all-reduce: with S = node size, of the ``≈ 3Ψ`` elements a micro-step moves only the gradient
hop, ``2(R-1)/R·Ψ/S·g`` bytes per rank, leaves the node, against every byte of plain ZeRO-3's
world collectives riding a ring that crosses nodes. The price is memory: S times less
sharding than ZeRO-3 over N (`memory.formulas.mics_model_state_bytes`).

With ``mics_hierarchical_params_gather`` a shard group that spans several nodes (S a multiple of
the node size k, ``LOCAL_WORLD_SIZE``) gathers in two levels, inside each node then across
(`comm.HierarchicalAllGather`): the same bytes, but the slow hops run between k-times-larger
messages, k rings side by side.

ZeRO++ inside the groups: ``zero_quantized_weights`` quantizes the shard group's gathers (the
`ZeroPP` gatherer over whichever group stage 3 runs on); ``zero_quantized_gradients`` makes hop
1 comm's one-hop quantized reduce-scatter (`TwoHopReduceScatter`), hop 2 exact. Refused by name
(`check_mics`): hpZ (MiCS's gathers are node-local already), replica groups, model parallelism.
Offload (``offload_param``, ``offload_optimizer``) moves the S-way partitions unchanged.

Set-up, in `zero.shard` (api.py), for ``ZeroConfig.mics_shard_size = S``: `check_mics` (local, on
every rank, before any collective: S divides N, what does not compose is refused by name), the
groups (`MicsGroups`, mics_groups.py: built once, by the engine's grid, by `zero.Init`, or
here), stage 3 (`assemble`) over the shard group with the two-hop reduce-scatter
(`TwoHopReduceScatter`) as its gradient reducer's collective, offload as usual, and
`MicsStrategy` around it (the clipping norm counts each shard once). Every rank starts from the
first rank's weights: partitioning broadcasts over the whole data-parallel group (Note
[partitioning starts from the first rank's values] in params.py). Nothing on the plain stage-3
path asks whether MiCS is on: it is the groups and the collective chosen here (Note [optional
features are chosen once] in strategy.py); each `ShardedParam` keeps its groups, so whatever
changes a value (`GatheredParameters`' modifier, a checkpoint's frozen parameters,
`set_full_fp32_param`, `zero.Init`'s initialisers) sends it to every replica, and ZeRO-Infinity's
I/O agreements run over the data-parallel group (`Stage3Strategy.data_group`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.comm.compression import BlockQuantizer, quantized_reduce_scatter_tensor
from minispeed.core import ranges
from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import StrategyWrapper
from minispeed.zero.stage3.assemble import assemble
from minispeed.zero.stage3.mics_groups import MicsGroups, check_mics, resolve_groups
from minispeed.zero.stage3.params import REGISTRY, ShardedParam, mark_issued
from minispeed.zero.stage3.strategy import Stage3Strategy

__all__ = ["HierarchicalGather", "MicsStrategy", "TwoHopReduceScatter", "mics_stage3"]


# -- gradients: the two hops -----------------------------------------------------------------------
class _ThenAcross:
    """The hop-1 handle; ``wait()`` finishes hop 1, then runs hop 2 (synchronously), once.

    ``is_completed()`` is False until waited for, so hop 2 is issued where the reducer waits
    (its window of buckets in flight, or the end of backward): the same point of the program on
    every rank, never "whenever a poll found hop 1 done", which would order collectives on two
    groups differently on different ranks.
    """

    __slots__ = ("_then", "_work")

    def __init__(self, work: Any, then: Any) -> None:
        self._work, self._then = work, then

    def wait(self) -> bool:
        if self._then is not None:
            self._work.wait()
            then, self._then, self._work = self._then, None, None
            then()
        return True

    def is_completed(self) -> bool:
        return self._then is None


class TwoHopReduceScatter:
    """The stage-3 reducer's collective under MiCS (``GradShardReducer(reduce_scatter=...)``):
    reduce-scatter over the shard group (``S·c·g`` bytes, message), then the all-reduce of my
    row over the replica group (``c·g``), divided by R. The reducer divides by S: the result
    is the mean over all N ranks.

    ``quantizer`` (qgZ, ``zero_quantized_gradients``): hop 1 is comm's one-hop quantized
    reduce-scatter inside the shard group (an all-to-all of ``q_b(S·P(c))`` bytes, one node: no
    second hop to save, unlike ZeRO++'s two-hop qgZ over the world), synchronous; hop 2, across
    the groups, stays exact: the one rounding is hop 1's, per element at most
    ``Σ_r max|block of g_r| / (2·qmax)`` (comm/compression/quantize.py)."""

    def __init__(self, groups: MicsGroups, quantizer: BlockQuantizer | None = None) -> None:
        self.replica_group = groups.replica_group
        self.replicas = groups.replicas
        self.quantizer = quantizer

    def __call__(
        self, output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        if self.quantizer is not None:
            with ranges.range("zero3.mics_qgz_reduce_scatter"):
                quantized_reduce_scatter_tensor(
                    output, input, quantizer=self.quantizer, group=group
                )
            self._across(output)
            return None
        work = comm.reduce_scatter_tensor(output, input, group=group, async_op=async_op)
        if work is None:
            self._across(output)
            return None
        return _ThenAcross(work, lambda: self._across(output))

    def _across(self, row: torch.Tensor) -> None:
        if self.replicas == 1:  # S = N (qgZ only): nothing across
            return
        with ranges.range("zero3.mics_all_reduce"):
            comm.all_reduce(row, group=self.replica_group)
        row.div_(self.replicas)


# -- parameters: the two-level gather ------------------------------------------------------------
class _Done:
    """The handle of a gather that already completed."""

    @staticmethod
    def wait() -> bool:
        return True

    @staticmethod
    def is_completed() -> bool:
        return True


class HierarchicalGather:
    """A `ShardedParam` gatherer (`PlainGather`'s contract, params.py) for a shard group spanning
    nodes: one two-level all-gather of the members' shards side by side (inside each node, then
    across), unpacked into each full buffer. Synchronous: an asynchronous request gets a handle
    that is already complete. Bytes: ``S·Σs·p`` gathered, logged as an intra-node and an
    inter-node all-gather; memory while gathering: ``k·Σs·p`` (the node buffer) plus
    ``S·Σs·p`` (the message) for several members, as for the coalesced plain gather."""

    def __init__(self, gather: comm.HierarchicalAllGather) -> None:
        self._gather = gather
        self._size = len(gather.ranks)

    def all_gather(self, todo: list[ShardedParam], async_op: bool) -> Any:
        """Gather ``todo`` (SHARDED, one shard group and dtype); marks them issued."""
        if len(todo) == 1:  # straight into its full buffer: rank-major rows are the layout
            self._gather.all_gather_into_tensor(todo[0].allocate_full(), todo[0].shard)
        else:
            mine = torch.cat([sp.shard for sp in todo])
            rows = mine.new_empty(self._size * mine.numel())
            self._gather.all_gather_into_tensor(rows, mine)
            rows = rows.view(self._size, -1)  # row r: rank r's shards side by side
            col = 0
            for sp in todo:
                full = sp.allocate_full().view(self._size, sp.shard_numel)
                full.copy_(rows[:, col : col + sp.shard_numel])
                col += sp.shard_numel
        work = _Done() if async_op else None
        mark_issued(todo, work, async_op)
        return work


# -- the strategy as the optimizer sees it -----------------------------------------------------------
class MicsStrategy(StrategyWrapper):
    """Stage 3 over a shard group, seen by `ZeroOptimizer` over all N ranks.

    The optimizer agrees on overflow and unused parameters over the data group (a parameter used
    on one replica only is used everywhere), and sums the clipping norm over it: each shard is
    held by R ranks, so each rank weighs its squares by 1/R (as replica groups do: Note [replica
    groups] in replica_groups.py). Owns the two-level gatherer, when there is one (parameters
    hold their gatherer weakly).
    """

    def __init__(self, strategy: Any, groups: MicsGroups) -> None:
        super().__init__(strategy)
        self.groups = groups
        self._gatherer: HierarchicalGather | None = None
        if groups.hierarchical is not None:
            self._gatherer = HierarchicalGather(groups.hierarchical)
            for sp in self.stage.sharded_params():
                sp.set_gatherer(self._gatherer)

    def grad_square_sum(self) -> torch.Tensor | None:
        """This rank's Σ g² over its shards, divided by R (the optimizer sums it over N ranks)."""
        own = self._inner.grad_square_sum()
        if own is None:
            own = torch.zeros(1)
            for gs in self._inner.master_grads():
                for g in gs:
                    own = own.to(g.device) + g.float().pow(2).sum()
        return own.reshape(1) / self.groups.replicas

    def close(self) -> None:
        """Stage 3's close (the last gather through our gatherer), then plain gathers again."""
        self._inner.close()
        if self._gatherer is not None:
            for sp in self.stage.sharded_params():
                sp.set_gatherer(None)


# -- set-up ------------------------------------------------------------------------------------------
def mics_stage3(
    model: nn.Module,
    config: ZeroConfig,
    precision: Any,
    group: Any,
    param_groups: list[list[nn.Parameter]],
    *,
    groups: MicsGroups | None,
    replica_groups: Any,
    model_parallel: Any,
) -> tuple[Stage3Strategy, MicsGroups]:
    """`zero.shard`'s stage 3 under MiCS: the checks (local, before any collective), the groups
    (`resolve_groups`: zero.Init's, ``groups``, or built here over ``group``, which must then be
    the world), and `Stage3Strategy` over the shard group with the two hops. Collective."""
    check_mics(
        config, comm.get_world_size(group), replica_groups=replica_groups,
        model_parallel=model_parallel,
    )  # fmt: skip
    built = (REGISTRY.get(p) for p in model.parameters())  # zero.Init's partitions, if any
    found = next((sp.mics for sp in built if sp is not None and sp.mics is not None), None)
    groups = resolve_groups(config, group, groups, found)
    quantizer = None  # qgZ: hop 1 quantized here, not ZeRO++'s two hops over the world
    if config.quantized_gradients:
        quantizer = BlockQuantizer(config.quantized_gradient_bits, config.quant_block_numel)
    reduce_scatter = None
    if groups.replicas > 1 or quantizer is not None:
        reduce_scatter = TwoHopReduceScatter(groups, quantizer)
    strategy = assemble(
        model,
        dataclasses.replace(config, quantized_gradients=False),
        precision,
        groups.shard_group,
        param_groups=param_groups,
        reduce_scatter=reduce_scatter,
        mics=groups,
    )
    return strategy, groups
