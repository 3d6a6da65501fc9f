"""The gate: choices, capacity, priority, drops, noise policies and the two router losses."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import minispeed.moe as moe
from minispeed.moe.gating import TopKGate


def _gate(num_experts: int, logits: torch.Tensor, **kw) -> tuple[TopKGate, torch.Tensor]:
    """A gate whose logits for the returned input are exactly `logits` (wg = identity)."""
    kw.setdefault("random_token_selection", False)
    cfg = moe.MoEConfig(num_experts=num_experts, **kw)
    gate = TopKGate(num_experts, cfg)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.eye(num_experts))
    return gate, logits.clone()


def test_aux_loss_matches_hand_computed_example():
    # probs per token: (0.9, 0.1), (0.6, 0.4), (0.3, 0.7), (0.8, 0.2); first choices 0, 0, 1, 0.
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.8, 0.2]])
    gate, x = _gate(2, probs.log(), min_capacity=4)
    r = gate(x)
    assert r.expert_index[:, 0].tolist() == [0, 0, 1, 0]
    # f = (3/4, 1/4), P = (0.65, 0.35): E · Σ f·P = 2 · (0.4875 + 0.0875) = 1.15
    assert r.aux_loss.item() == pytest.approx(1.15, rel=1e-6)
    assert moe.load_balancing_loss(probs, r.expert_index[:, 0]).item() == pytest.approx(1.15)
    # z-loss: logsumexp of log-probabilities is log(1) = 0
    assert r.z_loss.item() == pytest.approx(0.0, abs=1e-6)
    assert moe.router_z_loss(torch.zeros(3, 2)).item() == pytest.approx(math.log(2) ** 2)


def test_aux_loss_is_one_when_balanced_and_its_gradient_unloads_the_busy_expert():
    uniform = torch.full((4, 2), 0.5)
    assert moe.load_balancing_loss(uniform, torch.tensor([0, 1, 0, 1])).item() == pytest.approx(1)
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.8, 0.2]])
    gate, x = _gate(2, probs.log())
    r = gate(x)
    r.aux_loss.backward()
    with torch.no_grad():
        gate.wg.weight -= 1.0 * gate.wg.weight.grad
    after = gate(x).probs.mean(0)
    assert after[0] < r.probs.mean(0)[0]  # expert 0 had 3/4 of the tokens: its share falls


def test_capacity_formula():
    assert moe.capacity(12, 4, 2, 0.5, 1) == 3  # ceil(2·12/4 · 0.5)
    assert moe.capacity(12, 4, 1, 1.0, 5) == 5  # min_capacity wins
    assert moe.capacity(6, 2, 2, 4.0, 1) == 6  # never more than S
    assert moe.capacity(10, 3, 1, 1.25, 0) == math.ceil(10 / 3 * 1.25)


def test_top2_first_choices_take_precedence_and_drops_are_counted():
    # Token 0: first 0, second 1. Tokens 1, 2: first 1. Capacity 2 per expert.
    logits = torch.tensor([[3.0, 2.0, 0.0], [0.0, 3.0, 2.0], [0.0, 3.0, 2.0], [0.0, 0.0, 3.0]])
    gate, x = _gate(3, logits, top_k=2, capacity_factor=0.75, min_capacity=0)
    r = gate(x)
    assert r.capacity == 2  # ceil(2·4/3 · 0.75)
    assert r.expert_index.tolist() == [[0, 1], [1, 2], [1, 2], [2, 0]]
    # Expert 1 is offered tokens 1, 2 (first choices) before token 0's second choice.
    assert r.position[0, 1].item() == 2 and r.position[1, 0].item() == 0
    assert r.kept.tolist() == [[True, False], [True, True], [True, False], [True, True]]
    assert r.expert_counts.tolist() == [2, 3, 3]
    assert r.kept_counts.tolist() == [2, 2, 2]
    assert r.dropped_assignments == 2 and r.dropped_tokens == 0
    # Renormalized over the two choices.
    torch.testing.assert_close(r.weight.sum(1), torch.ones(4))


def test_no_drop_keeps_everything_and_fully_dropped_tokens_output_zero():
    logits = torch.tensor([[5.0, 0.0]] * 6)  # every token wants expert 0
    gate, x = _gate(2, logits, min_capacity=0, capacity_factor=1.0)
    r = gate(x)
    assert r.capacity == 3 and r.kept[:, 0].tolist() == [True] * 3 + [False] * 3
    assert r.dropped_tokens == 3
    gate_nd, _ = _gate(2, logits, drop_tokens=False)
    r_nd = gate_nd(x)
    assert r_nd.capacity is None and r_nd.kept.all() and r_nd.kept_counts.tolist() == [6, 0]
    layer = moe.MoE(2, nn.Linear(2, 2), gate.config)
    layer.gate = gate
    out = layer(x)
    assert torch.equal(out[3:], torch.zeros(3, 2)) and out[:3].abs().sum() > 0


def test_random_token_selection_keeps_capacity_many_at_random_in_training_only():
    logits = torch.tensor([[5.0, 0.0]] * 16)
    gate, x = _gate(2, logits, min_capacity=0, random_token_selection=True)
    torch.manual_seed(0)
    kept_sets = {tuple(gate(x).kept[:, 0].nonzero().flatten().tolist()) for _ in range(5)}
    assert len(kept_sets) > 1 and all(len(s) == 8 for s in kept_sets)
    gate.eval()
    assert gate(x).kept[:, 0].nonzero().flatten().tolist() == list(range(8))


def test_eval_uses_eval_capacity_factor():
    gate, x = _gate(2, torch.randn(20, 2), capacity_factor=0.5, eval_capacity_factor=2.0,
                    min_capacity=0)  # fmt: skip
    assert gate(x).capacity == 5
    gate.eval()
    assert gate(x).capacity == 20


@pytest.mark.parametrize("policy", ["jitter", "rsample"])
def test_noisy_policies_act_in_training_only(policy):
    torch.manual_seed(0)
    gate, x = _gate(4, torch.randn(64, 4), noisy_gate_policy=policy, drop_tokens=False)
    clean = x.argmax(1)
    a, b = gate(x), gate(x)
    if policy == "jitter":
        assert not torch.equal(a.logits, b.logits)
    else:
        assert not torch.equal(a.expert_index[:, 0], clean)  # Gumbel noise changed some picks
        torch.testing.assert_close(a.weight[:, 0], a.probs.gather(1, a.expert_index[:, :1])[:, 0])
    gate.eval()
    c, d = gate(x), gate(x)
    assert torch.equal(c.logits, d.logits) and torch.equal(c.expert_index[:, 0], clean)


def test_topk_general_choices_are_distinct_and_greedy():
    torch.manual_seed(1)
    gate, x = _gate(6, torch.randn(30, 6), top_k=3, drop_tokens=False)
    r = gate(x)
    assert torch.equal(r.expert_index, x.topk(3, dim=1).indices)
    assert all(len(set(row)) == 3 for row in r.expert_index.tolist())


def test_second_expert_sampling_explores_later_choices_in_training_only():
    torch.manual_seed(0)
    gate, x = _gate(6, torch.randn(64, 6), top_k=2, second_expert_sampling=True,
                    drop_tokens=False)  # fmt: skip
    greedy = x.topk(2, dim=1).indices
    r = gate(x)
    assert torch.equal(r.expert_index[:, 0], greedy[:, 0])  # the first choice stays greedy
    assert not torch.equal(r.expert_index[:, 1], greedy[:, 1])
    assert (r.expert_index[:, 1] != r.expert_index[:, 0]).all()
    gate.eval()
    assert torch.equal(gate(x).expert_index, greedy)
