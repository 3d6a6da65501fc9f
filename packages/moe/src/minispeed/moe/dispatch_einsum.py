"""The dense einsum formulation of dispatch and combine (GShard's), kept as the readable reference.

A one-hot dispatch mask (S, E, C) says which slot of which expert each token goes to, and the
combine weights (S, E, C) are that mask times the gate weights:

    dispatched[e, c, :] = Σ_s mask[s, e, c] · x[s, :]            einsum("sec,sd->ecd")
    out[s, :]           = Σ_{e,c} weights[s, e, c] · y[e, c, :]   einsum("sec,ecd->sd")

Simple and obviously right, but it costs S·E·C·d multiply-adds each way (with C ≈ k·S/E that is
k·S²·d: quadratic in the tokens) and S·E·C mask entries of memory, where the permutation
(`permute.py`) moves k·S·d elements. The tests check the permutation path against this one, and
`benchmarks/moe_dispatch.py` measures the gap. Without dropping, C is the largest kept count.
"""

from __future__ import annotations

import torch

from minispeed.moe.gating import Routing

__all__ = ["combine_weights", "dispatch_mask", "einsum_combine", "einsum_dispatch"]


def dispatch_mask(routing: Routing, capacity: int | None = None) -> torch.Tensor:
    """(S, E, C) one-hot of each kept assignment's (expert, position). C defaults to the
    routing's capacity, or the largest kept count when nothing is dropped."""
    num_experts = routing.kept_counts.shape[0]
    if capacity is None:
        capacity = routing.capacity
    if capacity is None:
        capacity = int(routing.kept_counts.max()) if num_experts else 0
    num_tokens = routing.expert_index.shape[0]
    mask = torch.zeros(num_tokens, num_experts, capacity, dtype=torch.float32)
    s, j = routing.kept.nonzero(as_tuple=True)
    mask[s, routing.expert_index[s, j], routing.position[s, j]] = 1.0
    return mask


def combine_weights(routing: Routing, mask: torch.Tensor) -> torch.Tensor:
    """(S, E, C): the gate weight of each kept assignment at its slot (differentiable)."""
    num_experts = mask.shape[1]
    # (S, k) weights spread onto (S, E): each token's k distinct experts get their weight.
    dense = torch.zeros(mask.shape[0], num_experts, dtype=routing.weight.dtype)
    dense = dense.scatter(1, routing.expert_index, routing.weight * routing.kept)
    return dense[:, :, None] * mask


def einsum_dispatch(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(E, C, d) expert inputs from tokens `x` (S, d): S·E·C·d multiply-adds."""
    return torch.einsum("sec,sd->ecd", mask.to(x.dtype), x)


def einsum_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(S, d) token outputs from expert outputs `y` (E, C, d): S·E·C·d multiply-adds."""
    return torch.einsum("sec,ecd->sd", weights.to(y.dtype), y)
