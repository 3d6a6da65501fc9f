"""A gate built from a DeepSpeed config routes as DeepSpeed 0.19.8's `TopKGate` does.

`fixtures/deepspeed_gating.json` holds DeepSpeed's outputs for 80 cases (E = 4, 6; S = 7, 13;
k = 1..4; dropping with two capacity factors, a binding `min_capacity`, train and eval; not
dropping), recorded by `fixtures/record_deepspeed_gating.py`. For each, the gate from
`MoEConfig.from_section` of the same arguments must give the same weight per (token,
expert) after dropping, the same kept assignments, expert counts and aux loss, and the same
gradients of the aux loss and of the weights with respect to the logits (fp32, 1e-5).
The one exception, documented: at k = 1 without random token selection DeepSpeed keeps
whichever tokens `torch.topk` returns among ties, so there only the counts kept per expert,
and the tokens both keep (or both drop), are compared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import minispeed.moe as moe

_FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "deepspeed_gating.json").read_text())
_CASES = _FIXTURE["cases"]


def _name(case: dict) -> str:
    mode = "train" if case["training"] else "eval"
    drop = (
        f"drop{case['capacity_factor']}-min{case['min_capacity']}"
        if case["drop_tokens"]
        else "nodrop"
    )
    return f"E{case['num_experts']}-S{len(case['logits'])}-k{case['k']}-{drop}-{mode}"


def _gate(case: dict) -> moe.TopKGate:
    cfg = moe.MoEConfig.from_section({
        "num_experts": case["num_experts"],
        "k": case["k"],
        "capacity_factor": case["capacity_factor"],
        "eval_capacity_factor": case["eval_capacity_factor"],
        "min_capacity": case["min_capacity"],
        "drop_tokens": case["drop_tokens"],
        "use_rts": case["use_rts"],
        "top2_2nd_expert_sampling": case["top2_2nd_expert_sampling"],
        "noisy_gate_policy": case["noisy_gate_policy"],
    })  # fmt: skip
    gate = moe.TopKGate(case["num_experts"], cfg)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.eye(case["num_experts"]))
    return gate.train(case["training"])


def _dense(routing: moe.Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, E) weight of each expert for each token (0 unless kept), and (S, E) kept."""
    num_tokens, num_experts = routing.probs.shape
    weights = torch.zeros(num_tokens, num_experts).scatter(
        1, routing.expert_index, routing.weight * routing.kept
    )
    kept = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(
        1, routing.expert_index, routing.kept
    )
    return weights, kept


@pytest.mark.parametrize("case", _CASES, ids=[_name(c) for c in _CASES])
def test_gate_from_section_matches_deepspeed(case):
    gate = _gate(case)
    x = torch.tensor(case["logits"]).requires_grad_()
    r = gate(x)
    weights, kept = _dense(r)
    close = {"rtol": 1e-5, "atol": 1e-6}
    want_kept = torch.tensor(case["kept"], dtype=torch.bool)
    same = torch.ones(len(want_kept), dtype=torch.bool)  # tokens compared row by row
    if case["k"] == 1 and case["drop_tokens"]:
        # DeepSpeed's top-1 without use_rts keeps whichever tokens torch.topk returns among
        # equal mask values (not token order): the same number per expert, not the same ones.
        assert kept.sum(0).tolist() == want_kept.sum(0).tolist()
        same = (kept == want_kept).all(dim=1)
    else:
        assert kept.tolist() == want_kept.tolist()
    # A token's weights and their gradient (a per-row softmax) depend on that token alone.
    torch.testing.assert_close(weights[same], torch.tensor(case["weights"])[same], **close)
    assert r.expert_counts.tolist() == case["expert_counts"]
    torch.testing.assert_close(r.aux_loss, torch.tensor(case["aux_loss"]), **close)
    (aux_grad,) = torch.autograd.grad(r.aux_loss, x, retain_graph=True)
    torch.testing.assert_close(aux_grad, torch.tensor(case["aux_grad"]), **close)
    (weight_grad,) = torch.autograd.grad((weights * torch.tensor(case["probe"])).sum(), x)
    want_grad = torch.tensor(case["weight_grad"])
    torch.testing.assert_close(weight_grad[same], want_grad[same], **close)
