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
groups (`MicsGroups`, built once, by the engine's grid or here), every rank started from the
first rank's weights (`start_equal`), stage 3 (`assemble`) over the shard group with the two-hop
reduce-scatter (`TwoHopReduceScatter`) as its gradient reducer's collective, offload as usual,
and `MicsStrategy` around it (the clipping norm counts each shard once). Nothing on the plain
stage-3 path asks whether MiCS is on: it is the group and the collective chosen here (Note
[optional features are chosen once] in strategy.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.comm.compression import BlockQuantizer, quantized_reduce_scatter_tensor
from minispeed.comm.validation import group_ranks
from minispeed.core import ranges
from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import StrategyWrapper
from minispeed.zero.stage3.assemble import assemble
from minispeed.zero.stage3.params import REGISTRY, ShardedParam, mark_issued
from minispeed.zero.stage3.strategy import Stage3Strategy
from minispeed.zero.stage3.zeropp import node_size_from_env

__all__ = [
    "HierarchicalGather",
    "MicsGroups",
    "MicsStrategy",
    "TwoHopReduceScatter",
    "check_mics",
    "mics_enabled",
    "mics_stage3",
    "start_equal",
]


def mics_enabled(config: ZeroConfig) -> bool:
    """Whether ``config`` asks for MiCS (``mics_shard_size`` >= 1)."""
    return config.mics_shard_size > 0


# -- errors at shard(), before any collective ------------------------------------------------------
def check_mics(
    config: ZeroConfig,
    data_size: int,
    *,
    replica_groups: Any = None,
    model_parallel: Any = None,
) -> None:
    """Refuse a MiCS set-up that cannot work, naming the fix. Local: every rank computes the same
    answer from the same config and sizes, so a bad S raises on every rank before any collective.
    """
    s = config.mics_shard_size
    if data_size % s:
        divisors = [d for d in range(1, data_size + 1) if data_size % d == 0]
        raise ValueError(
            f"zero_optimization.mics_shard_size={s} does not divide the data-parallel size "
            f"{data_size}: MiCS cuts the data-parallel ranks into groups of S; pick S among "
            f"{divisors} (usually the ranks of one node), or -1 to turn MiCS off"
        )
    if config.hpz_partition_size > 1:
        raise ValueError(
            "zero_hpz_partition_size with mics_shard_size: MiCS already keeps every parameter "
            "all-gather inside its shard group, so hpZ's node-local secondary partition has "
            "nothing left to save (and would hold a second copy); set zero_hpz_partition_size "
            "to 1, or drop mics_shard_size for hpZ over plain ZeRO-3"
        )
    if replica_groups is not None:
        raise ValueError(
            "mics_shard_size with replica_groups (MoE experts' expert-data groups): MiCS "
            "partitions over its shard groups and replicates over its replica groups, which "
            "cannot also follow the experts' groups; use one of the two"
        )
    if model_parallel is not None:
        raise ValueError(
            "mics_shard_size with model_parallel (tensor or pipeline axes) is not implemented: "
            "the tied-gradient sums and the norm over those axes are untested under MiCS; drop "
            "tensor_parallel.autotp_size, or mics_shard_size"
        )
    if config.mics_hierarchical_params_gather:
        k = node_size_from_env(data_size)
        if s % k or s == k or k == 1:
            raise ValueError(
                f"mics_hierarchical_params_gather with a shard group of {s} ranks and nodes of "
                f"{k} (LOCAL_WORLD_SIZE): a two-level gather needs a shard group spanning "
                f"several whole nodes (S a multiple of the node size, larger than it); set it to "
                f"false, or mics_shard_size to a multiple of {k}"
            )


# -- the groups --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MicsGroups:
    """This rank's MiCS groups: S ranks sharing the partitions, R ranks holding the same shard.

    Built once (`build`, collective over the world), by the engine's grid or by `zero.shard`.
    """

    shard_size: int
    """S: ranks of a shard group (the partitions are cut S ways)."""
    replicas: int
    """R = N/S: shard groups, i.e. copies of each shard."""
    data_group: Any
    """The N data-parallel ranks (None: the world): agreement and the norm run over it."""
    shard_group: Any
    """My S ranks: parameters gathered and gradients reduce-scattered over it."""
    replica_group: Any
    """My R ranks, one per shard group, each holding my shard: gradients all-reduced over it."""
    shard_ranks: tuple[int, ...]
    """Global ranks of my shard group, in order."""
    hierarchical: Any = None
    """`comm.HierarchicalAllGather` over my shard group (``mics_hierarchical_params_gather``)."""

    @classmethod
    def build(
        cls,
        shard_size: int,
        data_lines: Sequence[Sequence[int]] | None = None,
        *,
        data_group: Any = None,
        hierarchical: bool = False,
    ) -> MicsGroups:
        """Every rank's groups: each data-parallel line (global ranks; default: the world) cut
        into consecutive runs of ``shard_size``. Collective over the WORLD: every rank calls it
        with the same lines, in the same order (process groups are created on every rank).
        ``hierarchical``: also a two-level all-gather inside each shard group, nodes of
        ``LOCAL_WORLD_SIZE`` ranks (``mics_hierarchical_params_gather``)."""
        me = comm.get_rank()
        lines = [list(range(comm.get_world_size()))] if data_lines is None else data_lines
        node_size = node_size_from_env(comm.get_world_size()) if hierarchical else 0
        mine: tuple[Any, ...] | None = None
        for line in lines:
            replicas = len(line) // shard_size
            topo = comm.ProcessTopology(("replica", "shard"), (replicas, shard_size))
            grid = comm.ProcessGrid(topo, ranks=line)  # collective: every line on every rank
            hierarchical = {}
            for start in range(0, len(line), shard_size):  # one two-level gather per shard group
                ranks = list(line[start : start + shard_size])
                if node_size:
                    hierarchical[tuple(ranks)] = comm.HierarchicalAllGather(node_size, ranks)
            if me in line:
                shard_ranks = tuple(grid.group_ranks("shard"))
                mine = (
                    replicas,
                    grid.group("shard"),
                    grid.group("replica"),
                    shard_ranks,
                    hierarchical.get(shard_ranks),
                )
        if mine is None:
            raise ValueError(f"rank {me} is in none of the data-parallel lines {lines}")
        replicas, shard_group, replica_group, shard_ranks, hierarchical = mine
        return cls(
            shard_size, replicas, data_group, shard_group, replica_group, shard_ranks, hierarchical
        )


# -- the start ----------------------------------------------------------------------------------------
@torch.no_grad()
def start_equal(model: nn.Module, groups: MicsGroups) -> None:
    """Make every replica start from its replica group's first rank (in shard group 0), before
    stage 3 partitions each parameter from its shard group's first rank (Note [partitioning
    starts from the first rank's values] in params.py): together, every rank holds rank 0's
    weights. A parameter `zero.Init` already partitioned (over the shard group) sends its shard.
    Collective over the replica group: Ψ·p bytes once (Ψ/S·p for Init's shards)."""
    if groups.replicas == 1:
        return
    src = group_ranks(groups.replica_group)[0]
    for p in dict.fromkeys(model.parameters()):  # a tied parameter once
        sp = REGISTRY.get(p)
        tensor = p.data if sp is None else sp.shard
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        comm.broadcast(buf, src=src, group=groups.replica_group)
        if buf is not tensor:
            tensor.copy_(buf)


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
    (``groups``, or built here over ``group``, which must then be the world), the replicas
    started equal, and `Stage3Strategy` over the shard group with the two hops. Collective."""
    data_size = comm.get_world_size(group)
    check_mics(config, data_size, replica_groups=replica_groups, model_parallel=model_parallel)
    if groups is None:
        if data_size != comm.get_world_size():
            raise ValueError(
                f"zero.shard over a data-parallel group of {data_size} of "
                f"{comm.get_world_size()} ranks with mics_shard_size: build the groups over every "
                f"data-parallel line with zero.MicsGroups.build(S, lines, data_group=group) and "
                f"pass them as zero.shard(..., mics_groups=...) (the engine's grid does)"
            )
        groups = MicsGroups.build(
            config.mics_shard_size,
            data_group=group,
            hierarchical=config.mics_hierarchical_params_gather,
        )
    elif groups.shard_size * groups.replicas != data_size:
        raise ValueError(
            f"mics_groups cover {groups.shard_size} x {groups.replicas} ranks, but the "
            f"data-parallel group has {data_size}; build them over the same data-parallel lines"
        )
    start_equal(model, groups)
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
    )
    return strategy, groups
