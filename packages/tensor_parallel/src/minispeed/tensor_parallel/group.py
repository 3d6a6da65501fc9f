"""The tensor-parallel group a layer splits over: this rank's index, the size, the handle.

Every layer and `parallelize` take the group from the caller (a handle from
`minispeed.comm.new_group`, a `ProcessGrid` with a `"tensor"` axis, or a `TensorGroup`) and never
build one: in 3D parallelism the tensor axis is one axis of the engine's grid, so a second group
built over the world behind the caller's back would be wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import minispeed.comm as comm

__all__ = ["TensorGroup"]


@dataclass(frozen=True)
class TensorGroup:
    """This rank's place in a tensor-parallel group: index `rank` of `size`, the `group` handle."""

    rank: int
    """This rank's index in the group, 0..size-1: which shard it keeps."""
    size: int
    """Ranks that split each layer (n)."""
    group: Any = None
    """The handle `minispeed.comm` collectives take (`None`: the default group, the world)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TensorGroup rank {self.rank} is outside 0..{self.size - 1}")

    @classmethod
    def of(cls, group: Any) -> TensorGroup:
        """The `TensorGroup` of this rank from a `TensorGroup`, a `ProcessGrid` (its `"tensor"`
        axis, or `"model"`), a handle from `comm.new_group`, or `None` (the world's default group,
        which must be initialized). Collective only in that it reads the group's rank and size."""
        if isinstance(group, cls):
            return group
        if not comm.is_initialized():
            raise RuntimeError(
                "tensor parallelism needs a process group: call minispeed.comm.init_distributed() "
                "on every rank first (or launch with torchrun)"
            )
        if isinstance(group, comm.ProcessGrid):
            axes = group.topology.axes
            axis = "tensor" if "tensor" in axes else "model" if "model" in axes else None
            if axis is None:
                raise ValueError(
                    f"the ProcessGrid given as the tensor-parallel group has axes {list(axes)}: "
                    "it needs a 'tensor' (or 'model') axis"
                )
            return cls(group.rank_in(axis), group.size(axis), group.group(axis))
        rank = comm.get_rank(group)
        if rank < 0:
            raise ValueError("the tensor-parallel group does not contain this rank")
        return cls(rank, comm.get_world_size(group), group)
