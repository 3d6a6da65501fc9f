"""Process grids over named axes: each rank's coordinates and the process group along each axis.

Two objects, split by whether they communicate:

* `ProcessTopology` is pure arithmetic (no torch.distributed): axes such as
  `("pipe", "data", "model")` with sizes `(2, 2, 1)`, ranks laid out row-major (the LAST axis
  varies fastest, so `model` neighbours are adjacent ranks, which is where one wants the
  chattiest axis: on the same node).
* `ProcessGrid` creates the process groups, collectively: every rank builds every group,
  in one fixed order (axes in order, then each axis's groups by their lowest rank), because
  `new_group` must be called by all ranks with the same arguments in the same order.

Example with axes `(pipe, data)` and dims `(2, 2)`:

```text
rank:   0      1      2      3
coord:  (0,0)  (0,1)  (1,0)  (1,1)
data groups: [0, 1], [2, 3]      pipe groups: [0, 2], [1, 3]
```

Cost: one process group per (axis, line of the grid): Σ_axis world/dim(axis) groups, each with
its own communicator (NCCL reserves buffers per communicator, so avoid groups you do not need).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from minispeed.comm.groups import get_rank, get_world_size, new_group

__all__ = ["ProcessGrid", "ProcessTopology"]


@dataclass(frozen=True)
class ProcessTopology:
    """A row-major grid of `prod(dims)` ranks over named `axes`."""

    axes: tuple[str, ...]
    """Axis names, outermost first (e.g. `("pipe", "data", "model")`)."""
    dims: tuple[int, ...]
    """Size of each axis; their product is the number of ranks."""

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        object.__setattr__(self, "axes", tuple(axes))
        object.__setattr__(self, "dims", tuple(int(d) for d in dims))
        self.__post_init__()

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.dims) or not self.axes:
            raise ValueError(
                f"ProcessTopology: {len(self.axes)} axes {list(self.axes)} but {len(self.dims)} dims "
                f"{list(self.dims)}; give one size per axis (at least one axis)"
            )
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(
                f"ProcessTopology: axis names repeat in {list(self.axes)}; use distinct names"
            )
        if any(d < 1 for d in self.dims):
            raise ValueError(f"ProcessTopology: dims {list(self.dims)} must all be >= 1")

    @property
    def world_size(self) -> int:
        """Ranks in the grid: the product of `dims`."""
        return math.prod(self.dims)

    def dim(self, axis: str) -> int:
        """Size of `axis`."""
        return self.dims[self._axis_index(axis)]

    def get_coord(self, rank: int) -> dict[str, int]:
        """Coordinates of grid rank `rank`, e.g. `{"pipe": 1, "data": 0}`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the grid [0, {self.world_size})")
        coord = {}
        for axis, d in zip(reversed(self.axes), reversed(self.dims)):
            rank, coord[axis] = divmod(rank, d)
        return {a: coord[a] for a in self.axes}

    def get_rank(self, **coord: int) -> int:
        """Grid rank at `coord` (every axis must be given)."""
        missing = [a for a in self.axes if a not in coord]
        extra = [a for a in coord if a not in self.axes]
        if missing or extra:
            raise ValueError(
                f"get_rank needs exactly the axes {list(self.axes)}; missing {missing}, unknown {extra}"
            )
        rank = 0
        for axis, d in zip(self.axes, self.dims):
            if not 0 <= coord[axis] < d:
                raise ValueError(f"coordinate {axis}={coord[axis]} is outside [0, {d})")
            rank = rank * d + coord[axis]
        return rank

    def axis_groups(self, axis: str) -> list[list[int]]:
        """Every line of the grid along `axis`: ranks that differ only in `axis`, sorted by
        their lowest rank. These partition the grid into `world_size / dim(axis)` groups."""
        self._axis_index(axis)
        lines: dict[tuple, list[int]] = {}
        for r in range(self.world_size):
            c = self.get_coord(r)
            key = tuple(v for a, v in c.items() if a != axis)
            lines.setdefault(key, []).append(r)
        return sorted(lines.values(), key=lambda ranks: ranks[0])

    def ranks_with(self, **fixed: int) -> list[int]:
        """Grid ranks whose coordinates match `fixed` (e.g. `ranks_with(pipe=0)`)."""
        for a in fixed:
            self._axis_index(a)
        return [
            r
            for r in range(self.world_size)
            if all(self.get_coord(r)[a] == v for a, v in fixed.items())
        ]

    def _axis_index(self, axis: str) -> int:
        if axis not in self.axes:
            raise ValueError(f"unknown axis {axis!r}; this topology has {list(self.axes)}")
        return self.axes.index(axis)


class ProcessGrid:
    """A `ProcessTopology` mapped onto processes, with one process group per axis line.

    Collective: every rank of the world constructs it, with the same arguments. `ranks` maps
    grid rank i to global rank `ranks[i]` (default: global rank i); ranks outside the grid
    still take part in group creation and get `coord = None`.
    """

    def __init__(self, topology: ProcessTopology, ranks: Sequence[int] | None = None) -> None:
        world = get_world_size()
        self.topology = topology
        self.ranks = list(range(topology.world_size)) if ranks is None else [int(r) for r in ranks]
        if len(self.ranks) != topology.world_size:
            raise ValueError(
                f"ProcessGrid: topology {dict(zip(topology.axes, topology.dims))} has "
                f"{topology.world_size} ranks but {len(self.ranks)} processes were given; make "
                "the product of dims equal the number of processes"
            )
        if len(set(self.ranks)) != len(self.ranks) or not all(0 <= r < world for r in self.ranks):
            raise ValueError(
                f"ProcessGrid: ranks {self.ranks} must be distinct global ranks in [0, {world})"
            )
        me = get_rank()
        self.grid_rank: int | None = self.ranks.index(me) if me in self.ranks else None
        self.coord: dict[str, int] | None = (
            None if self.grid_rank is None else topology.get_coord(self.grid_rank)
        )
        self._groups: dict[str, Any] = {}
        self._group_ranks: dict[str, list[int]] = {}
        # Same order on every rank. See the module docstring.
        for axis in topology.axes:
            for line in topology.axis_groups(axis):
                global_line = [self.ranks[g] for g in line]
                group = new_group(global_line)
                if me in global_line:
                    self._groups[axis], self._group_ranks[axis] = group, global_line

    def group(self, axis: str) -> Any:
        """This rank's process group along `axis`."""
        self._require_member()
        self.topology._axis_index(axis)
        return self._groups[axis]

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along `axis`, in axis order."""
        self._require_member()
        self.topology._axis_index(axis)
        return list(self._group_ranks[axis])

    def size(self, axis: str) -> int:
        """Ranks along `axis`."""
        return self.topology.dim(axis)

    def rank_in(self, axis: str) -> int:
        """This rank's coordinate along `axis` (= its rank in `group`)."""
        self._require_member()
        assert self.coord is not None
        return self.coord[axis]

    def _require_member(self) -> None:
        if self.grid_rank is None:
            raise ValueError(
                f"global rank {get_rank()} is not part of this grid (ranks {self.ranks})"
            )
