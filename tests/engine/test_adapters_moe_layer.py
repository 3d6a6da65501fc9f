"""`minispeed.engine.moe.layer.MoE` on one process: DeepSpeed's outputs (output shape, l_aux
unscaled and differentiable, exp_counts before dropping), experts starting as copies of `expert`,
Residual MoE mixing the dense expert in, and the refusals of what minispeed lacks."""

import pytest
import torch
from torch import nn

from minispeed.engine.moe import MoE, split_params_into_different_moe_groups_for_optimizer
from minispeed.engine.moe.utils import is_moe_param


def _expert():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def test_outputs_and_expert_copies_are_deepspeeds():
    torch.manual_seed(0)
    expert = _expert()
    layer = MoE(8, expert, num_experts=4, k=1, min_capacity=0, use_rts=False)
    for local in layer.deepspeed_moe.experts.local_experts:
        for a, b in zip(local.parameters(), expert.parameters()):
            assert torch.equal(a, b) and a is not b
    x = torch.randn(3, 5, 8)
    out, l_aux, counts = layer(x)
    assert out.shape == x.shape and counts.dtype == torch.int64 and int(counts.sum()) == 15
    probs = torch.softmax(x.reshape(-1, 8) @ layer.deepspeed_moe.gate.wg.weight.t(), dim=-1)
    first = torch.nn.functional.one_hot(probs.argmax(1), 4).float()
    want = (probs.mean(0) * first.mean(0)).sum() * 4  # DeepSpeed's top1gating l_aux
    torch.testing.assert_close(l_aux, want)
    assert l_aux.requires_grad
    assert all(is_moe_param(p) for p in layer.deepspeed_moe.experts.parameters())
    assert not any(is_moe_param(p) for p in layer.deepspeed_moe.gate.parameters())


def test_residual_moe_mixes_the_dense_expert():
    torch.manual_seed(0)
    layer = MoE(8, _expert(), num_experts=2, use_residual=True, min_capacity=0)
    x = torch.randn(6, 8)
    out, _, _ = layer(x)
    moe_out = layer.deepspeed_moe(x)
    coef = torch.softmax(layer.coefficient(x), dim=-1)
    torch.testing.assert_close(out, moe_out * coef[:, :1] + layer.mlp(x) * coef[:, 1:])
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(layer.parameters()), "name": "p"}
    )
    assert [g["name"] for g in groups] == ["p", "ep_size_1"]
    assert len(groups[1]["params"]) == 2 * 4  # two experts × (2 weights + 2 biases)


@pytest.mark.parametrize(
    "kwargs,word",
    [
        ({"use_tutel": True}, "use_tutel"),
        ({"enable_expert_tensor_parallelism": True}, "enable_expert_tensor_parallelism"),
        ({"k": 5}, "k=5"),
        ({"noisy_gate_policy": "jitter"}, "noisy_gate_policy"),
    ],
)
def test_what_minispeed_lacks_is_refused_by_name(kwargs, word):
    with pytest.raises((NotImplementedError, ValueError), match=word):
        MoE(8, _expert(), num_experts=4, **kwargs)


def test_groups_need_a_name():
    with pytest.raises(KeyError, match="name"):
        split_params_into_different_moe_groups_for_optimizer({"params": []})


def test_deepspeeds_moe_utils_find_and_split_the_experts():
    from minispeed.engine.moe import utils

    torch.manual_seed(0)
    layer = MoE(8, _expert(), num_experts=2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), layer)
    assert utils.has_moe_layers(model) == (True, 2)
    assert utils.has_moe_layers(torch.nn.Linear(2, 2)) == (False, 0)
    params = list(model.parameters())
    shared, expert = utils.split_params_into_shared_and_expert_params(params)
    assert {id(p) for p in expert} == {id(p) for p in layer.deepspeed_moe.experts.parameters()}
    assert len(shared) + len(expert) == len(params) and all(
        not utils.is_moe_param(p) for p in shared
    )
    model(torch.randn(4, 8))[0].sum().backward()
    shared_g, expert_g = utils.split_params_grads_into_shared_and_expert_params(params)
    assert [g.data_ptr() for g in expert_g] == [p.grad.data_ptr() for p in expert]
    assert len(shared_g) == sum(p.grad is not None for p in shared)
    # a list of parameters -> "dense-params" plus the experts' group; groups already split stay
    groups = utils.configure_moe_param_groups(params)
    assert [g["name"] for g in groups] == ["dense-params", "ep_size_1"]
    assert utils.configure_moe_param_groups(groups) is groups
    with pytest.raises(TypeError, match="parameter or a parameter group"):
        utils.configure_moe_param_groups(["weights"])
