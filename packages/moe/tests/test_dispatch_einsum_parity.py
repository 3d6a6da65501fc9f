"""The permutation dispatch computes what the dense one-hot einsum formulation computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minispeed.moe as moe
from minispeed.moe import dispatch_einsum as de


def _einsum_forward(layer: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """The same layer written with the (S, E, C) dispatch mask (routing taken from the layer)."""
    r = layer.last_routing
    tokens = x.reshape(-1, x.shape[-1])
    mask = de.dispatch_mask(r)
    dispatched = de.einsum_dispatch(tokens, mask)  # (E, C, d)
    y = torch.stack([e(dispatched[i]) for i, e in enumerate(layer.experts.local_experts)])
    return de.einsum_combine(y, de.combine_weights(r, mask)).reshape(x.shape)


# DeepSpeed's rules (what from_section picks for k >= 3) move the same rows differently.
_DEEPSPEED_RULES = {"drop_order": "probability", "weights_over": "kept", "aux_loss_choices": "all"}


@pytest.mark.parametrize("rules", [{}, _DEEPSPEED_RULES], ids=["gshard", "deepspeed"])
@pytest.mark.parametrize("drop", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_permutation_equals_einsum_forward_and_backward(drop, top_k, rules):
    torch.manual_seed(top_k)
    cfg = moe.MoEConfig(num_experts=4, top_k=top_k, capacity_factor=0.75, min_capacity=1,
                        drop_tokens=drop, random_token_selection=False, **rules)  # fmt: skip
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    layer = moe.MoE(16, mlp, cfg)
    x = torch.randn(3, 10, 16, requires_grad=True)
    out = layer(x)
    ref = _einsum_forward(layer, x)
    if drop:
        assert layer.last_routing.dropped_assignments > 0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    params = [x, layer.gate.wg.weight, *layer.experts.parameters()]
    got = torch.autograd.grad(out.square().sum(), params, retain_graph=True)
    want = torch.autograd.grad(ref.square().sum(), params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_plan_layout_groups_slots_by_expert():
    logits = torch.tensor([[3.0, 0.0], [0.0, 3.0], [3.0, 0.0]])
    cfg = moe.MoEConfig(num_experts=2, min_capacity=4, random_token_selection=False)
    gate = moe.TopKGate(2, cfg)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.eye(2))
    r = gate(logits)
    plan = moe.plan_dispatch(r)  # padded: E·C rows, for the equal-split all-to-all
    assert r.capacity == 3  # min_capacity 4, but never more than S = 3
    assert plan.rows_per_expert == [3, 3]
    assert plan.slot_token.tolist() == [0, 2, -1, 1, -1, -1]
    assert plan.token_slot.tolist() == [[0], [3], [1]]
    compact = moe.plan_dispatch(r, padded=False)  # all experts local: no empty rows
    assert compact.rows_per_expert == [2, 1]
    assert compact.slot_token.tolist() == [0, 2, 1]
    assert compact.token_slot.tolist() == [[0], [2], [1]]
    nodrop = moe.plan_dispatch(
        moe.TopKGate(2, moe.MoEConfig(num_experts=2, drop_tokens=False)).eval()(logits)
    )
    assert sum(nodrop.rows_per_expert) == 3 and (nodrop.slot_token >= 0).all()
