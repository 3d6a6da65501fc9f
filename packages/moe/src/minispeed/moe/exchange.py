"""Send each expert's rows to the rank that holds it, and the outputs back: the all-to-alls.

Every rank's buffer is grouped by global expert (see `dispatch.py`), and experts are laid out
rank-major (rank r of the expert group holds experts [r·E_l, (r+1)·E_l), E_l = E/E_p), so the
rows for rank r are one contiguous chunk: an all-to-all moves them with no extra packing.

- **dropping**: every chunk is E_l·C rows on every rank, so one equal-split all-to-all. The
  received rows are ordered (source rank, local expert, slot); a transpose groups them by local
  expert: (E_l, E_p·C) rows each.
- **no dropping**: first an all-to-all of the E kept counts (E int64 per rank) so each rank
  learns how many rows it will receive from each source for each local expert, then an
  uneven-split all-to-all of the rows, then a permutation (a gather through the op) that groups
  the (source, expert)-ordered rows by expert.

The backward of an all-to-all is the all-to-all with the splits swapped
(`comm.all_to_all_autograd`, shared with Ulysses' sequence all-to-all). Bytes on
the wire per call: `costs.all_to_all_bytes`.
"""

from __future__ import annotations

import dataclasses

import torch

import minispeed.comm as comm
from minispeed.moe import permute as perm
from minispeed.moe.groups import ExpertGroups

__all__ = ["Exchange", "send_to_experts"]


@dataclasses.dataclass
class Exchange:
    """What `send_to_experts` did, so `return_to_tokens` can undo it."""

    local_rows_per_expert: list[int]
    """Rows each local expert received (from all sources together)."""
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    regroup: torch.Tensor | None = None  # (rows,) received row each expert-grouped row reads
    ungroup: torch.Tensor | None = None  # (rows,) its inverse
    capacity: int | None = None

    def return_to_tokens(self, y: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """Expert outputs (grouped by local expert) back to this rank's buffer (by global expert)."""
        ep = groups.expert_parallel_degree
        if self.capacity is not None:
            e_local = len(self.local_rows_per_expert)
            d = y.shape[1:]
            # (E_l, E_p, C) -> (E_p, E_l, C): rows for source rank s are chunk s again.
            y = y.reshape(e_local, ep, self.capacity, *d).transpose(0, 1).reshape(-1, *d)
            return comm.all_to_all_autograd(y, groups.expert_group)
        assert self.regroup is not None and self.ungroup is not None
        y = perm.permute(y, self.ungroup, self.regroup[:, None])
        return comm.all_to_all_autograd(y, groups.expert_group, self.send_splits, self.recv_splits)


def send_to_experts(
    buf: torch.Tensor, rows_per_expert: list[int], capacity: int | None, groups: ExpertGroups
) -> tuple[torch.Tensor, Exchange]:
    """Move `buf` (rows grouped by global expert) to the ranks holding the experts.

    Returns the rows this rank's experts must process, grouped by local expert, and the
    `Exchange` that sends their outputs back.
    """
    ep = groups.expert_parallel_degree
    num_experts = len(rows_per_expert)
    e_local = num_experts // ep
    if capacity is not None:
        recv = comm.all_to_all_autograd(
            buf, groups.expert_group
        )  # (E_p · E_l · C, d), source-major
        d = recv.shape[1:]
        grouped = recv.reshape(ep, e_local, capacity, *d).transpose(0, 1).reshape(-1, *d)
        return grouped, Exchange([ep * capacity] * e_local, capacity=capacity)
    # No dropping: counts first, then rows with uneven splits.
    counts = torch.tensor(rows_per_expert, dtype=torch.int64, device=buf.device)
    recv_counts = torch.empty_like(counts)
    comm.all_to_all_single(recv_counts, counts, group=groups.expert_group)
    by_source = recv_counts.view(ep, e_local)  # [s, e]: rows from source s for local expert e
    send_splits = counts.view(ep, e_local).sum(1).tolist()
    recv_splits = by_source.sum(1).tolist()
    recv = comm.all_to_all_autograd(buf, groups.expert_group, recv_splits, send_splits)
    # Group the (source, expert)-ordered rows by expert: row (e, s, i) reads (s, e, i).
    flat = by_source.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(ep, e_local).t().reshape(-1)  # (e, s) order
    sizes = by_source.t().reshape(-1)
    dest_starts = torch.cumsum(sizes, 0) - sizes
    total = int(sizes.sum())
    regroup = torch.repeat_interleave(starts - dest_starts, sizes) + torch.arange(
        total, device=buf.device
    )
    ungroup = torch.empty_like(regroup)
    ungroup[regroup] = torch.arange(regroup.numel(), device=regroup.device)
    grouped = perm.permute(recv, regroup, ungroup[:, None])
    local_rows = by_source.sum(0).tolist()
    return grouped, Exchange(local_rows, send_splits, recv_splits, regroup, ungroup)
