"""Average gradients: dense parameters over all W ranks, expert parameters over W / E_p.

Note [expert gradient scale]
The global loss is the mean of the W ranks' losses, L = (1/W) Σ_r L_r. A dense parameter's
gradient on rank r is ∂L_r/∂θ, so L's gradient is the SUM over W ranks divided by W (an
all-reduce over the data-parallel world). An expert's gradient on the rank holding it already
sums the contributions of every rank of its expert group (their tokens came through the
all-to-all, and so did the gradient), i.e. Σ_{r ∈ expert group} ∂L_r/∂θ_e; summing that over
the expert-data group (the W/E_p ranks holding the same expert) covers all W ranks. So both
kinds are summed over their group and divided by the SAME W, not by their group's size.

Cost per step (fp32, ring all-reduce): dense 2(W−1)/W · 4Ψ_dense bytes sent per rank, experts
2(W/E_p − 1)/(W/E_p) · 4Ψ_local_experts: each gradient travels in one flat all-reduce per kind.
"""

from __future__ import annotations

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.core import ranges
from minispeed.moe.experts import Experts
from minispeed.moe.groups import ExpertGroups

__all__ = ["dense_parameters", "expert_parameters", "reduce_gradients"]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters inside `Experts` modules (this rank's share of the experts)."""
    seen: dict[int, nn.Parameter] = {}
    for m in model.modules():
        if isinstance(m, Experts):
            for p in m.parameters():
                seen.setdefault(id(p), p)
    return list(seen.values())


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter (replicated on all W ranks, gates included)."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]


def _average(params: list[nn.Parameter], group, world_size: int) -> None:
    """Sum the gradients over `group` in one flat all-reduce and divide by `world_size`."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # 1D, numel = Σ numel
    comm.all_reduce(flat, group=group)
    flat /= world_size
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def reduce_gradients(model: nn.Module, groups: ExpertGroups) -> None:
    """Average the gradients of `model` as Note [expert gradient scale] says. Collective.

    A parameter without a gradient takes part with zeros (so every rank issues the same calls)
    and leaves with the averaged gradient.
    """
    if groups.world_size == 1:
        return
    with ranges.range("moe.reduce_gradients"):
        _average(dense_parameters(model), None, groups.world_size)
        if groups.expert_data_size > 1:
            _average(expert_parameters(model), groups.expert_data_group, groups.world_size)
        else:  # each expert lives on one rank only: nothing to sum, only the 1/W scale
            for p in expert_parameters(model):
                if p.grad is not None:
                    p.grad /= groups.world_size
