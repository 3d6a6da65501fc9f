"""MiCS's groups: which ranks share the partitions (a shard group), which hold the same shard.

`MicsGroups` is built once (by the engine's grid, by `zero.Init`, or by `zero.shard`) and
handed to whatever partitions over it; every `ShardedParam` partitioned over a shard group
keeps it (``ShardedParam.mics``), so that a value one rank changes reaches every rank holding
the shard (`GatheredParameters`, over ``data_group``), and so that `zero.shard` finds the groups
`zero.Init` built (`resolve_groups`). The checks that need the world's size (`check_mics`)
are local: every rank computes the same answer before any collective. What runs over the
groups (the two gradient hops, the two-level gather) is in mics.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import minispeed.comm as comm
from minispeed.comm.validation import group_ranks
from minispeed.zero.config import ZeroConfig
from minispeed.zero.stage3.zeropp import node_size_from_env

__all__ = ["MicsGroups", "check_mics", "mics_enabled", "resolve_groups"]


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
    """The N data-parallel ranks (None: the world), every shard's holders: agreements, the norm
    and a changed value's broadcast (`GatheredParameters`' modifier) run over it."""
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

    def same_ranks(self, other: MicsGroups) -> bool:
        """Whether ``other`` cuts the same ranks into the same groups (built separately: the
        engine's grid and `zero.Init` each build theirs). Local."""
        return self._ranks() == other._ranks()

    def _ranks(self) -> tuple[Any, ...]:
        replicas, data = group_ranks(self.replica_group), group_ranks(self.data_group)
        return self.shard_size, self.shard_ranks, tuple(replicas), tuple(data)


def resolve_groups(
    config: ZeroConfig, group: Any, given: MicsGroups | None, found: MicsGroups | None = None
) -> MicsGroups:
    """The groups to partition over: those `zero.Init` partitioned the model with (``found``,
    from its parameters), else ``given`` (the engine's grid built them), else built here over
    ``group``, the data-parallel group, which must then be the world. Checks first (local, on
    every rank: the same answer everywhere, before any collective); collective only when it
    builds (`MicsGroups.build`: process groups over the world)."""
    data_size = comm.get_world_size(group)
    if found is not None:
        have = (found.shard_size, found.hierarchical is not None)
        want = (config.mics_shard_size, config.mics_hierarchical_params_gather)
        if have != want:
            raise ValueError(
                f"zero.Init partitioned the model over MiCS shard groups of {have[0]} ranks "
                f"(mics_hierarchical_params_gather={have[1]}), but zero.shard's config asks for "
                f"{want[0]} (mics_hierarchical_params_gather={want[1]}); give both the same "
                f"ZeroConfig"
            )
        if given is not None and given is not found and not found.same_ranks(given):
            raise ValueError(
                f"zero.Init partitioned the model over the MiCS shard group {found.shard_ranks}, "
                f"but zero.shard got mics_groups whose shard group is {given.shard_ranks}; build "
                f"both over the same data-parallel lines (or pass zero.Init's groups, "
                f"Init.mics_groups)"
            )
        return found  # the parameters' own: `given` (same ranks) would be a second set
    if given is not None:
        if given.shard_size * given.replicas != data_size:
            raise ValueError(
                f"mics_groups cover {given.shard_size} x {given.replicas} ranks, but the "
                f"data-parallel group has {data_size}; build them over the same data-parallel "
                f"lines"
            )
        return given
    if data_size != comm.get_world_size():
        raise ValueError(
            f"MiCS over a data-parallel group of {data_size} of {comm.get_world_size()} ranks: "
            f"build the groups over every data-parallel line with zero.MicsGroups.build(S, "
            f"lines, data_group=group) and pass them as zero.shard(..., mics_groups=...) or "
            f"zero.Init(..., mics_groups=...) (the engine's grid does)"
        )
    return MicsGroups.build(
        config.mics_shard_size,
        data_group=group,
        hierarchical=config.mics_hierarchical_params_gather,
    )
