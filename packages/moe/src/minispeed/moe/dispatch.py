"""The dispatch plan: where each kept assignment sits in the expert-grouped buffer.

The buffer holds one row per slot, grouped by expert (expert 0's slots, then expert 1's, ...):

- padded (dropping, before an all-to-all): E·C slots, expert e owns rows [e·C, (e+1)·C);
  assignment (s, j) of expert e at position p < C sits in row e·C + p; unused slots stay empty
  (zero rows). Every rank's buffer has the same shape, so the all-to-all uses equal splits.
- compact (no dropping, or dropping with all experts local): exactly Σ kept rows; expert e owns
  `kept_counts[e]` rows starting at the sum of the counts before it. Kept positions of an expert
  are 0 .. kept_counts[e] − 1 (kept iff position < C), so row = start[e] + position. Ranks'
  buffers differ in size, so an all-to-all of them uses uneven splits; with every expert local
  the experts skip the E·C − Σ kept empty rows the padded layout would make them compute.

The two index maps are each other's inverse, and every data movement is a gather through one
of them (see `permute.py`): `slot_token[i]` (token of slot i, −1 if empty) and
`token_slot[s, j]` (slot of assignment (s, j), −1 if dropped). Cost of building the plan:
O(k·S) index arithmetic, no (S, E, C) tensor.
"""

from __future__ import annotations

import dataclasses

import torch

from minispeed.moe.gating import Routing

__all__ = ["DispatchPlan", "plan_dispatch"]


@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """Slots of the expert-grouped buffer for one rank's tokens."""

    slot_token: torch.Tensor
    """(num_slots,) int64: token each slot reads, −1 for an empty slot."""
    token_slot: torch.Tensor
    """(S, k) int64: slot of each assignment, −1 where dropped."""
    rows_per_expert: list[int]
    """Slots each expert owns, in expert order (C each when dropping, else the kept counts)."""

    @property
    def num_slots(self) -> int:
        """Rows of the buffer: E·C when dropping, Σ kept counts otherwise."""
        return int(self.slot_token.shape[0])


def plan_dispatch(routing: Routing, padded: bool | None = None) -> DispatchPlan:
    """Lay out `routing`'s kept assignments expert by expert (see the module docstring).

    `padded` defaults to whether the routing has a capacity; it must be False without one.
    """
    expert_index, position, kept = routing.expert_index, routing.position, routing.kept
    num_tokens, k = expert_index.shape
    num_experts = routing.kept_counts.shape[0]
    if padded is None:
        padded = routing.capacity is not None
    if padded and routing.capacity is None:
        raise ValueError("plan_dispatch: a padded layout needs a capacity (drop_tokens=True)")
    if padded:
        rows = [routing.capacity] * num_experts
        slot = expert_index * routing.capacity + position
    else:
        counts = routing.kept_counts
        rows = counts.tolist()
        slot = (torch.cumsum(counts, 0) - counts)[expert_index] + position
    token_slot = torch.where(kept, slot, torch.full_like(slot, -1))
    slot_token = torch.full((sum(rows),), -1, dtype=torch.int64, device=expert_index.device)
    tokens = torch.arange(num_tokens, device=expert_index.device)[:, None].expand(num_tokens, k)
    slot_token[token_slot[kept]] = tokens[kept]
    return DispatchPlan(slot_token=slot_token, token_slot=token_slot, rows_per_expert=rows)
