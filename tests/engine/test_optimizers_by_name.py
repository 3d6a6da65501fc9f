"""Optimizers by ds_config name: DeepSpeed 0.19.8's choice of class and hyper-parameters.

`fixtures/ds_optimizers.json` holds, for each `"optimizer"` section with and without offload,
the class DeepSpeed's `_configure_basic_optimizer` built and its hyper-parameters (or the error
it raised), recorded by `scripts/record_ds_schedules.py`. Our class is the stand-in for
DeepSpeed's (`STAND_IN`), and every hyper-parameter DeepSpeed ends up with must be ours too,
including the AdamW mode (`"Adam"` is AdamW unless `adam_w_mode: false`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from minispeed.comm.optim import OnebitAdam, OnebitLamb
from minispeed.engine.optim import build_optimizer
from minispeed.offload import CPUAdagrad, CPUAdam, CPULion, Lion

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "ds_optimizers.json").read_text())
CASES = {case["name"]: case for case in FIXTURE["cases"]}

# DeepSpeed's kernel class -> ours. torch.optim classes stand for themselves.
STAND_IN = {
    "FusedAdam": (torch.optim.Adam, torch.optim.AdamW),
    "DeepSpeedCPUAdam": (CPUAdam,),
    "FusedLion": (Lion,),
    "DeepSpeedCPULion": (CPULion,),
    "DeepSpeedCPUAdagrad": (CPUAdagrad,),
}
COMPARED = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "momentum",
    "dampening",
    "nesterov",
    "lr_decay",
    "initial_accumulator_value",
    "alpha",
    "centered",
)

# Sections DeepSpeed 0.19.8 refuses that minispeed builds, on purpose (docs page, "different").
BUILT_WHERE_DEEPSPEED_FAILS = {
    "sgd_lowercase": torch.optim.SGD,  # type names are case-insensitive for every type here
    "onebit_adam_removed": OnebitAdam,  # removed from DeepSpeed; minispeed.comm has it
    "onebit_lamb_removed": OnebitLamb,
}


def params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3))]


def ds_decoupled(case: dict[str, Any]) -> bool | None:
    """Whether DeepSpeed's Adam decouples weight decay (AdamW), or None if not an Adam."""
    hyper = case["hyper"]
    for key in ("adam_w_mode", "adamw_mode", "decoupled_weight_decay"):
        if key in hyper:
            return bool(hyper[key])
    return None


def our_decoupled(optimizer: torch.optim.Optimizer) -> bool | None:
    group = optimizer.param_groups[0]
    for key in ("adamw_mode", "decoupled_weight_decay"):
        if key in group:
            return bool(group[key])
    return None


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if "class" in c))
def test_optimizer_class_and_hyperparameters_equal_deepspeeds(name: str) -> None:
    case = CASES[name]
    optimizer = build_optimizer(case["section"], params(), offload=case["offload"])
    theirs = case["class"]
    expected = (
        (getattr(torch.optim, theirs.removeprefix("torch.optim.")),)
        if theirs.startswith("torch.optim.")
        else STAND_IN[theirs]
    )
    assert type(optimizer) in expected, f"{name}: {type(optimizer)} for DeepSpeed's {theirs}"
    group = optimizer.param_groups[0]
    for key in COMPARED:
        if key in case["hyper"]:
            # An optimizer with no AMSGrad variant (Adagrad) has no `amsgrad` key: it is off.
            ours = group.get(key, False) if key == "amsgrad" else group[key]
            ours = list(ours) if key == "betas" else ours
            assert ours == case["hyper"][key], f"{name}: {key} {ours!r} != {case['hyper'][key]!r}"
    assert our_decoupled(optimizer) == ds_decoupled(case), f"{name}: AdamW mode differs"


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if "error" in c))
def test_sections_deepspeed_refuses_are_refused_or_built_on_purpose(name: str) -> None:
    case = CASES[name]
    if name in BUILT_WHERE_DEEPSPEED_FAILS:
        built = build_optimizer(case["section"], params(), offload=case["offload"])
        assert type(built) is BUILT_WHERE_DEEPSPEED_FAILS[name]
        return
    with pytest.raises(ValueError) as info:
        build_optimizer(case["section"], params(), offload=case["offload"])
    # The message names the type or the param at fault.
    named = [case["section"]["type"], *case["section"].get("params", {})]
    assert any(repr(word) in str(info.value) for word in named), str(info.value)


def test_onebit_adam_gets_deepspeeds_freeze_step_default_and_the_group() -> None:
    optimizer = build_optimizer({"type": "OneBitAdam", "params": {"lr": 1e-3}}, params())
    assert optimizer.freeze_step == 100000
    lamb = build_optimizer(
        {
            "type": "onebitlamb",
            "params": {"freeze_step": 7, "max_coeff": 5.0, "comm_backend_name": "nccl"},
        },
        params(),
    )
    assert (lamb.freeze_step, lamb.param_groups[0]["max_coeff"]) == (7, 5.0)


# Every key DeepSpeed accepts for a type, at its default: accepted. At another value that
# minispeed does not implement: refused by name.
@pytest.mark.parametrize(
    ("section", "offload"),
    [
        (
            {
                "type": "Adam",
                "params": {
                    "bias_correction": True,
                    "amsgrad": False,
                    "set_grad_none": True,
                    "fp32_optimizer_states": True,
                    "adam_w_mode": True,
                    "torch_adam": False,
                },
            },
            False,
        ),
        (
            {
                "type": "AdamW",
                "params": {
                    "bias_correction": True,
                    "amsgrad": False,
                    "fp32_optimizer_states": True,
                },
            },
            True,
        ),
        (
            {"type": "Adam", "params": {"torch_adam": True, "foreach": False, "maximize": False}},
            False,
        ),
        ({"type": "Lion", "params": {"set_grad_none": True, "fp32_optimizer_states": True}}, False),
        ({"type": "Lion", "params": {"fp32_optimizer_states": True}}, True),
        ({"type": "Adagrad", "params": {"amsgrad": False, "fp32_optimizer_states": True}}, True),
        ({"type": "AdamW", "params": {}, "legacy_fusion": False}, False),
        (
            {
                "type": "OneBitAdam",
                "params": {
                    "bias_correction": True,
                    "eps_inside_sqrt": False,
                    "amsgrad": False,
                    "cuda_aware": False,
                },
            },
            False,
        ),
    ],
)
def test_deepspeed_keys_at_their_defaults_are_accepted(section: dict, offload: bool) -> None:
    build_optimizer(section, params(), offload=offload)


@pytest.mark.parametrize(
    ("section", "offload", "needle"),
    [
        ({"type": "Adam", "params": {"bias_correction": False}}, False, "'bias_correction'"),
        ({"type": "Adam", "params": {"set_grad_none": False}}, False, "'set_grad_none'"),
        ({"type": "Adam", "params": {"set_grad_none": True}}, True, "'set_grad_none'"),
        (
            {"type": "AdamW", "params": {"fp32_optimizer_states": False}},
            True,
            "'fp32_optimizer_states'",
        ),
        ({"type": "Adam", "params": {"adam_w_mode": "yes"}}, False, "'adam_w_mode'"),
        ({"type": "AdamW", "params": {"weight_decya": 0.1}}, False, "did you mean 'weight_decay'"),
        (
            {"type": "AdamW", "params": {"torch_adam": True, "bias_correction": True}},
            False,
            "'bias_correction'",
        ),
        ({"type": "Adma", "params": {}}, False, "did you mean 'Adam'"),
        ({"type": "Lamb", "params": {}}, False, "FusedLamb"),
        ({"type": "Muon", "params": {}}, False, "not implemented"),
        ({"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}, False, "did you mean 'momentum'"),
        ({"type": "Lion", "params": {"beta": [0.9, 0.99]}}, False, "did you mean 'betas'"),
        ({"type": "OneBitAdam", "params": {"cuda_aware": True}}, False, "'cuda_aware'"),
        (
            {"type": "OneBitAdam", "params": {"comm_backend_name": "mpi"}},
            False,
            "'comm_backend_name'",
        ),
        ({"type": "OneBitLamb", "params": {}}, True, "cannot be offloaded"),
        ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, False, "gradient_clipping"),
        ({"type": "AdamW", "param": {}}, False, "did you mean 'params'"),
        ({"type": "AdamW", "legacy_fusion": True}, False, "legacy_fusion"),
        ({"type": "AdamW", "params": {"betas": [0.9]}}, False, "params.betas: must be two"),
        ({"type": "Adam", "params": {"betas": [0.9]}}, True, "params.betas: must be two"),
        ({"type": "AdamW", "params": {"lr": "3e-4"}}, False, "params.lr: must be a number"),
        ({"type": "SGD", "params": {"lr": 0.1, "momentum": "0.9"}}, False, "momentum: must be"),
        ({"type": "Lion", "params": {"weight_decay": "0.1"}}, False, "weight_decay: must be"),
    ],
)
def test_bad_optimizer_section_is_a_value_error_naming_the_fix(
    section: dict, offload: bool, needle: str
) -> None:
    with pytest.raises(ValueError) as info:
        build_optimizer(section, params(), offload=offload)
    assert needle in str(info.value), str(info.value)


def test_param_groups_keep_their_own_settings() -> None:
    decay, no_decay = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    groups = [{"params": [decay]}, {"params": [no_decay], "weight_decay": 0.0, "lr": 0.5}]
    optimizer = build_optimizer(
        {"type": "Adam", "params": {"lr": 0.1, "weight_decay": 0.1}}, groups
    )
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (0.1, 0.1),
        (0.5, 0.0),
    ]


def test_the_section_is_not_mutated() -> None:
    section = {"type": "Adam", "params": {"lr": 0.1, "adam_w_mode": False, "torch_adam": False}}
    build_optimizer(section, params())
    assert section == {
        "type": "Adam",
        "params": {"lr": 0.1, "adam_w_mode": False, "torch_adam": False},
    }


def deepspeed_lion_reference(p, m, grads, lr, beta1, beta2, weight_decay):
    """DeepSpeed's CPU Lion kernel (csrc/lion/cpu_lion_impl.cpp, scalar path), elementwise in fp32."""
    p, m = p.clone(), m.clone()
    lr32, after_decay = torch.tensor(lr), 1 - torch.tensor(lr) * torch.tensor(weight_decay)
    for g in grads:
        for k in range(p.numel()):
            c = m[k] * beta1 + g[k] * (1 - beta1)
            update = -torch.copysign(lr32, c)
            p[k] = p[k] * after_decay + update if weight_decay > 0 else p[k] + update
            m[k] = m[k] * beta2 + g[k] * (1 - beta2)
    return p, m


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("offload", [False, True])
def test_lion_steps_equal_deepspeeds_kernel(weight_decay: float, offload: bool) -> None:
    torch.manual_seed(0)
    start = torch.randn(37)
    grads = [torch.randn(37) for _ in range(5)]
    param = torch.nn.Parameter(start.clone())
    section = {
        "type": "Lion",
        "params": {"lr": 0.01, "betas": [0.9, 0.99], "weight_decay": weight_decay},
    }
    optimizer = build_optimizer(section, [param], offload=offload)
    for g in grads:
        param.grad = g.clone()
        optimizer.step()
    expected_p, expected_m = deepspeed_lion_reference(
        start, torch.zeros(37), grads, 0.01, 0.9, 0.99, weight_decay
    )
    torch.testing.assert_close(param.detach(), expected_p, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(optimizer.state[param]["exp_avg"], expected_m, rtol=1e-6, atol=1e-7)


def test_lion_leaves_a_parameter_with_zero_gradient_and_momentum_in_place() -> None:
    """The one documented difference: sign(0) = 0 (DeepSpeed moves it by +-lr)."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = Lion([param], lr=0.1)
    param.grad = torch.zeros(4)
    optimizer.step()
    assert torch.equal(param.detach(), torch.ones(4))


def test_lion_bf16_parameter_updates_in_fp32() -> None:
    param = torch.nn.Parameter(torch.full((4,), 1.0, dtype=torch.bfloat16))
    optimizer = Lion([param], lr=0.5, weight_decay=0.5)
    param.grad = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=torch.bfloat16)
    optimizer.step()
    # p (1 - lr wd) - lr sign(c) = 0.75 -+ 0.5
    assert param.detach().float().tolist() == [0.25, 1.25, 0.25, 1.25]


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_offloaded_adam_follows_the_same_rule_as_on_device(kind: str, adam_w_mode: bool) -> None:
    """The AdamW mode reaches offload's CPU kernel: same trajectory as the torch class chosen
    without offload (an L2/decoupled mix-up differs by ~lr·wd·p per step, far above rtol)."""
    torch.manual_seed(0)
    start, grads = torch.randn(64), [torch.randn(64) for _ in range(5)]
    section = {
        "type": kind,
        "params": {"lr": 0.05, "weight_decay": 0.2, "adam_w_mode": adam_w_mode},
    }
    finals = []
    for offload in (False, True):
        param = torch.nn.Parameter(start.clone())
        optimizer = build_optimizer(section, [param], offload=offload)
        for g in grads:
            param.grad = g.clone()
            optimizer.step()
        finals.append(param.detach())
    torch.testing.assert_close(finals[1], finals[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_an_auto_placeholder_in_params_names_its_key(section: str) -> None:
    """HF Trainer-style configs used without the Trainer: DeepSpeed fails with a TypeError deep
    in the constructor; here a ConfigError names the key."""
    from minispeed.engine.lr_schedules import build_scheduler

    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=rf'{section}\.params\.lr.*"auto".*Hugging Face'):
        if section == "optimizer":
            build_optimizer({"type": "AdamW", "params": {"lr": "auto"}}, [w])
        else:
            build_scheduler(
                {"type": "OneCycle", "params": {"lr": "auto"}}, torch.optim.SGD([w], lr=0.1)
            )
