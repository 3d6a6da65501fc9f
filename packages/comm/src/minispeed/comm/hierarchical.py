"""Two-level all-gather (MiCS-style): gather inside each node first, then across nodes.

With n = N nodes × L ranks per node, laid out node-major (global rank = node · L + local), and m
elements per rank:

1. intra-node all-gather over the L ranks of the node: every rank now holds its node's L·m
   elements (fast links: NVLink, shared memory);
2. inter-node all-gather over the N ranks with the same local index, one such group per local
   index running side by side: each gathers N node buffers of L·m elements. Because ranks are
   node-major, the result `[node 0 | node 1 | ...]` is exactly the flat all-gather's
   `[rank 0 | rank 1 | ...]`: no reordering.

Cost per rank (e = element bytes): sends (L-1)·m·e inside the node plus (N-1)·L·m·e across nodes,
(n-1)·m·e in all, the same bytes as a flat ring; but the slow inter-node hops take N-1 steps
(alpha terms) instead of n-1, the L inter-node rings run in parallel over all NICs, and each
inter-node message is L times larger (better bandwidth). Memory: the L·m node buffer.

The flat version stays the reference: `minispeed.comm.all_gather_into_tensor`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minispeed.comm import collectives
from minispeed.comm.groups import get_rank, get_world_size
from minispeed.comm.topology import ProcessGrid, ProcessTopology
from minispeed.comm.validation import (
    CommInputError,
    check_numel,
    check_same_dtype,
    check_tensors,
)

__all__ = ["HierarchicalAllGather"]


class HierarchicalAllGather:
    """All-gather over global `ranks` (the world when `None`) in two levels, `node_size`
    ranks per node; `ranks` are node-major (the first `node_size` form node 0, ...).

    Construction is collective over the WORLD (it creates the intra- and inter-node groups, and
    group creation involves every rank), also for ranks outside `ranks`.
    """

    def __init__(self, node_size: int, ranks: Sequence[int] | None = None) -> None:
        ranks = list(range(get_world_size())) if ranks is None else [int(r) for r in ranks]
        n = len(ranks)
        if node_size < 1 or n % node_size != 0:
            raise ValueError(
                f"node_size={node_size} must divide the number of ranks {n}; use the number of ranks "
                "per node (LOCAL_WORLD_SIZE under torchrun)"
            )
        self.node_size = node_size
        self.num_nodes = n // node_size
        # node-major layout: axis "local" (fastest) = rank within the node.
        self.ranks = ranks
        topo = ProcessTopology(axes=("node", "local"), dims=(self.num_nodes, node_size))
        self.grid = ProcessGrid(topo, ranks=ranks)
        member = self.grid.grid_rank is not None
        self.intra_group = self.grid.group("local") if member else None  # the L ranks of this node
        self.inter_group = self.grid.group("node") if member else None  # N ranks, same local index

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Same contract as `minispeed.comm.all_gather_into_tensor` on the group (synchronous).

        Logged as two `all_gather` records: group size L (intra) and N (inter).
        """
        if self.grid.grid_rank is None:
            raise CommInputError(
                f"hierarchical_all_gather: global rank {get_rank()} is not one of the ranks "
                f"{self.ranks} this all-gather spans; call it only on those ranks"
            )
        n = len(self.ranks)
        check_tensors("hierarchical_all_gather", self.intra_group, output, input)
        check_same_dtype("hierarchical_all_gather", output, input)
        check_numel(
            "hierarchical_all_gather",
            "output",
            output.numel(),
            n * input.numel(),
            f"allocate output with {n} * input.numel() elements",
        )
        flat_in = input.reshape(-1)
        node_buf = flat_in.new_empty(self.node_size * flat_in.numel())  # 1D, L·m: this node's ranks
        collectives.all_gather_into_tensor(node_buf, flat_in, group=self.intra_group)
        collectives.all_gather_into_tensor(output.view(-1), node_buf, group=self.inter_group)
