"""Bad MoE settings fail at construction with an error that names the fix; DeepSpeed keys map."""

from __future__ import annotations

import pytest
from torch import nn

import minispeed.moe as moe
from minispeed.core.testing import run_distributed


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_experts": 6, "expert_parallel_degree": 4}, "not divisible by expert_parallel"),
        ({"num_experts": 4, "top_k": 5}, "top_k=5 exceeds num_experts=4"),
        ({"num_experts": 4, "capacity_factor": 0.0}, "MoEConfig.capacity_factor: must be > 0"),
        ({"num_experts": 4, "capacity_factor": -1.0}, "MoEConfig.capacity_factor: must be > 0"),
        (
            {"num_experts": 4, "eval_capacity_factor": 0},
            "MoEConfig.eval_capacity_factor: must be > 0",
        ),
        ({"num_experts": 0}, "MoEConfig.num_experts: must be an int >= 1"),
        ({"num_experts": 4, "min_capacity": -1}, "min_capacity"),
        (
            {"num_experts": 4, "noisy_gate_policy": "gumbel"},
            "MoEConfig.noisy_gate_policy: must be one of",
        ),
        ({"num_experts": 4, "drop_order": "token"}, "MoEConfig.drop_order: must be one of"),
        ({"num_experts": 4, "weights_over": "all"}, "MoEConfig.weights_over: must be one of"),
        ({"num_experts": 4, "aux_loss_choices": 2}, "MoEConfig.aux_loss_choices: must be one of"),
        ({"num_experts": 4, "drop_order": "probability"}, "set random_token_selection=False"),
    ],
)
def test_bad_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        moe.MoEConfig(**kwargs)


def test_from_section_translates_deepspeed_keys():
    cfg = moe.MoEConfig.from_section(
        {
            "num_experts": 8,
            "ep_size": 2,
            "k": 2,
            "capacity_factor": 1.25,
            "min_capacity": 2,
            "noisy_gate_policy": "Jitter",
            "drop_tokens": False,
            "use_rts": False,
            "use_residual": False,
        }
    )
    assert cfg == moe.MoEConfig(
        num_experts=8,
        expert_parallel_degree=2,
        top_k=2,
        capacity_factor=1.25,
        min_capacity=2,
        noisy_gate_policy="jitter",
        drop_tokens=False,
        random_token_selection=False,
        second_expert_sampling=True,  # DeepSpeed's default for top2_2nd_expert_sampling
        weights_over="kept",  # DeepSpeed renormalizes over the surviving choices
    )
    assert (
        moe.MoEConfig.from_section(
            {"num_experts": 2, "noisy_gate_policy": "None"}
        ).noisy_gate_policy
        is None
    )
    # The options DeepSpeed's routine for a k ignores are off; k >= 3 ranks by probability.
    top1 = moe.MoEConfig.from_section({"num_experts": 4, "noisy_gate_policy": "RSample"})
    assert (top1.noisy_gate_policy, top1.random_token_selection) == ("rsample", True)
    assert not top1.second_expert_sampling
    top3 = moe.MoEConfig.from_section(
        {"num_experts": 4, "k": 3, "noisy_gate_policy": "RSample", "use_rts": True}
    )
    assert top3.noisy_gate_policy is None and not top3.random_token_selection
    assert not top3.second_expert_sampling
    assert (top3.drop_order, top3.aux_loss_choices) == ("probability", "all")
    with pytest.raises(ValueError, match=r"moe\.experts: unknown key"):
        moe.MoEConfig.from_section({"experts": 8})
    with pytest.raises(ValueError, match=r"moe\.use_residual: DeepSpeed's 'use_residual' is not"):
        moe.MoEConfig.from_section({"num_experts": 8, "use_residual": True})
    with pytest.raises(ValueError, match=r"^moe.num_experts: required"):
        moe.MoEConfig.from_section({"k": 1})


def test_expert_parallel_without_a_process_group_is_refused():
    with pytest.raises(ValueError, match=r"call minispeed\.comm\.init_distributed"):
        moe.MoE(4, nn.Linear(4, 4), moe.MoEConfig(num_experts=4, expert_parallel_degree=2))


def test_replace_mlp_without_a_match_is_refused():
    with pytest.raises(ValueError, match="no submodule named 'mlp'"):
        moe.replace_mlp(nn.Sequential(nn.Linear(2, 2)), moe.MoEConfig(num_experts=2))


def _groups_must_tile(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError, match="does not tile the world of 2 ranks") as err:
        moe.ExpertGroups(4)
    cfg = moe.MoEConfig(num_experts=4, expert_parallel_degree=2)
    with pytest.raises(ValueError, match="groups were built for expert_parallel_degree=1"):
        moe.MoE(4, nn.Linear(4, 4), cfg, groups=moe.ExpertGroups(1))
    return str(err.value)


def test_groups_that_do_not_tile_the_world_fail_on_every_rank():
    messages = run_distributed(_groups_must_tile, world_size=2)
    assert all("pick a divisor of 2" in m for m in messages)
