"""Ranks with different numbers of tokens (a short last batch) agree on one capacity.

With dropping on, each rank's capacity C follows its own token count S; the equal-split
all-to-all needs one C on every rank of an expert group, so the layer takes the group's maximum
(one all-reduce of one int64). On W = E_p = 2 with 12 and 5 tokens (and 12 and 0), the layer's
output, its router losses and every gradient equal one process holding all experts that routes
each rank's batch with that agreed capacity (the dense einsum formulation, fp32). Without
dropping (uneven splits) the same batches need no agreement and give the same equality.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minispeed.moe as moe
from minispeed.core.testing import run_distributed
from minispeed.moe import dispatch_einsum as de

HIDDEN, NUM_EXPERTS = 8, 4


def _config(ep: int, drop: bool) -> moe.MoEConfig:
    return moe.MoEConfig(num_experts=NUM_EXPERTS, expert_parallel_degree=ep, top_k=2,
                         capacity_factor=0.5, min_capacity=1, random_token_selection=False,
                         drop_tokens=drop, aux_loss_coef=0.1, z_loss_coef=0.01)  # fmt: skip


def _layer(ep: int, drop: bool, groups: moe.ExpertGroups | None = None) -> moe.MoE:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(HIDDEN, 16), nn.GELU(), nn.Linear(16, HIDDEN))
    layer = moe.MoE(HIDDEN, mlp, _config(ep, drop), groups)
    with torch.no_grad():
        layer.gate.wg.weight.copy_(torch.randn(NUM_EXPERTS, HIDDEN, generator=_gen(99)))
    return layer


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(rank: int, tokens: list[int]) -> torch.Tensor:
    return torch.randn(tokens[rank], HIDDEN, generator=_gen(rank))


def _run_rank(rank: int, world_size: int, tokens: list[int], drop: bool) -> dict:
    layer = _layer(world_size, drop, moe.ExpertGroups(world_size))
    x = _batch(rank, tokens).requires_grad_()
    out = layer(x)
    (out.square().sum() + layer.loss).backward()
    grads = {f"expert{g}.{n}": p.grad.clone() for g, e in zip(layer.experts.global_ids,
             layer.experts.local_experts) for n, p in e.named_parameters()}  # fmt: skip
    return {"out": out.detach(), "x_grad": x.grad, "gate_grad": layer.gate.wg.weight.grad,
            "loss": layer.loss.detach(), "capacity": layer.last_routing.capacity, **grads}  # fmt: skip


def _reference(tokens: list[int], drop: bool) -> list[dict]:
    """One process, all experts, each rank's batch routed with the largest rank's capacity."""
    layer = _layer(1, drop)
    cfg = layer.config
    agreed = max(moe.capacity(s, NUM_EXPERTS, cfg.top_k, cfg.capacity_factor, cfg.min_capacity)
                 for s in tokens) if drop else None  # fmt: skip
    results = []
    for rank in range(len(tokens)):
        layer.zero_grad()
        x = _batch(rank, tokens).requires_grad_()
        r = layer.gate(x, capacity=agreed)
        mask = de.dispatch_mask(r)
        ys = de.einsum_dispatch(x, mask)  # (E, C, d)
        y = torch.stack([e(ys[i]) for i, e in enumerate(layer.experts.local_experts)])
        out = de.einsum_combine(y, de.combine_weights(r, mask))
        loss = cfg.aux_loss_coef * r.aux_loss + cfg.z_loss_coef * r.z_loss
        (out.square().sum() + loss).backward()
        res = {"out": out.detach(), "x_grad": x.grad, "gate_grad": layer.gate.wg.weight.grad,
               "loss": loss.detach(), "capacity": agreed}  # fmt: skip
        for g, e in enumerate(layer.experts.local_experts):
            for n, p in e.named_parameters():
                res[f"expert{g}.{n}"] = p.grad.clone()
        results.append(res)
    return results


@pytest.mark.parametrize("drop", [True, False], ids=["drop", "nodrop"])
@pytest.mark.parametrize("tokens", [[12, 5], [12, 0]])
def test_unequal_token_counts_agree_on_capacity_and_match_one_process(tokens, drop):
    got = run_distributed(_run_rank, world_size=2, args=(tokens, drop), timeout_s=60)
    want = _reference(tokens, drop)
    if drop:  # the ranks' own capacities really differ
        assert want[0]["capacity"] > moe.capacity(tokens[1], NUM_EXPERTS, 2, 0.5, 1)
    for rank in range(2):
        assert got[rank]["capacity"] == want[rank]["capacity"]
        # Expert gradients: rank r holds experts 2r, 2r+1, summed over both ranks' tokens.
        for name, g in got[rank].items():
            if name.startswith("expert"):
                torch.testing.assert_close(g, sum(w[name] for w in want if name in w),
                                           rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")  # fmt: skip
            elif name != "capacity":
                torch.testing.assert_close(g, want[rank][name], rtol=1e-5, atol=1e-6,
                                           msg=f"rank {rank} {name}")  # fmt: skip
