"""Expert-parallel and expert-data-parallel groups, from minispeed.comm's process grid.

The W ranks of the data-parallel world form a grid with axes `("expert_data", "expert")` and
dims `(W / E_p, E_p)`; the last axis varies fastest, so an expert-parallel group is E_p
adjacent ranks (on one node, where the all-to-all is cheapest):

    W = 4, E_p = 2:   rank      0  1  2  3
                      expert    0  1  0  1     expert groups:      [0, 1], [2, 3]
                      e. data   0  0  1  1     expert-data groups: [0, 2], [1, 3]

Tokens travel inside an expert group (all-to-all); the ranks of an expert-data group hold the
same experts and average those experts' gradients; dense parameters average over all W.
Building the groups is collective (every rank, same order): create one `ExpertGroups` and
share it between layers.
"""

from __future__ import annotations

from typing import Any

import minispeed.comm as comm

__all__ = ["ExpertGroups"]


class ExpertGroups:
    """The process groups one expert-parallel degree needs (collective to construct).

    Without an initialized process group and with E_p = 1 it is a local stand-in (world 1, no
    groups), so `pip install minispeed-moe` works in a plain single-process script.
    """

    def __init__(self, expert_parallel_degree: int) -> None:
        ep = expert_parallel_degree
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(
                f"ExpertGroups: expert_parallel_degree must be an int >= 1, got {ep!r}"
            )
        self.expert_parallel_degree = ep
        if not comm.is_initialized():
            if ep != 1:
                raise ValueError(
                    f"ExpertGroups: expert_parallel_degree={ep} needs a process group; call "
                    "minispeed.comm.init_distributed() first (or launch with torchrun)"
                )
            self.world_size, self.rank = 1, 0
            self.expert_rank, self.expert_group, self.expert_data_group = 0, None, None
            self.expert_data_size = 1
            return
        world = comm.get_world_size()
        if world % ep:
            raise ValueError(
                f"ExpertGroups: expert_parallel_degree={ep} does not tile the world of {world} "
                f"ranks; pick a divisor of {world}: "
                f"{[d for d in range(1, world + 1) if world % d == 0]}"
            )
        self.world_size, self.rank = world, comm.get_rank()
        grid = comm.ProcessGrid(comm.ProcessTopology(("expert_data", "expert"), (world // ep, ep)))
        self.grid = grid
        self.expert_rank = grid.rank_in("expert")
        self.expert_group: Any = grid.group("expert")
        self.expert_data_group: Any = grid.group("expert_data")
        self.expert_data_size = world // ep

    @property
    def distributed(self) -> bool:
        """Whether tokens cross ranks (E_p > 1)."""
        return self.expert_parallel_degree > 1

    def __repr__(self) -> str:
        return (
            f"ExpertGroups(world={self.world_size}, expert_parallel_degree="
            f"{self.expert_parallel_degree}, expert_rank={self.expert_rank})"
        )
