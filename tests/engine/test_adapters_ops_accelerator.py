"""`deepspeed.ops.adam` and `deepspeed.accelerator` under their minispeed paths.

Scripts build `FusedAdam` / `DeepSpeedCPUAdam` themselves and ask `get_accelerator()` for
device names; both paths must import and answer as DeepSpeed 0.19.8 does on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minispeed.engine as deepspeed
from minispeed.core.testing import run_distributed
from minispeed.engine.accelerator import get_accelerator
from minispeed.engine.ops.adam import DeepSpeedCPUAdam, FusedAdam
from minispeed.engine.runtime.base_optimizer import DeepSpeedOptimizer
from minispeed.offload import CPUAdam

# DeepSpeed 0.19.8's CPU accelerator, recorded with
# `env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -c "from deepspeed.accelerator
# import get_accelerator as g; a = g(); print(a.device_name(), ...)"`.
DEEPSPEED_CPU = {
    "device_name": "cpu",
    "current_device_name": "cpu",
    "communication_backend_name": "gloo",
    "device_count": 1,
    "is_available": True,
    "current_device": 0,
    "is_synchronized_device": True,
    "use_host_timers": True,
}


def test_accelerator_answers_deepspeeds_names_on_the_cpu(monkeypatch):
    monkeypatch.setenv("MINISPEED_ACCELERATOR", "cpu")
    acc = get_accelerator()
    assert {name: getattr(acc, name)() for name in DEEPSPEED_CPU} == DEEPSPEED_CPU
    assert acc.device_name(0) == "cpu"
    acc.manual_seed_all(7)
    first = torch.rand(3)
    acc.manual_seed(7)
    assert torch.equal(torch.rand(3), first)
    acc.synchronize()  # core's own methods pass through


def _losses(optimizer_cls, steps=4, **kwargs):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(6))
    opt = optimizer_cls([w], lr=0.05, weight_decay=0.1, **kwargs)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = (w**3).sum() + w.square().sum()
        loss.backward()
        opt.step()
        out.append(w.detach().clone())
    return torch.stack(out)


def test_fused_adam_is_adamw_or_l2_adam():
    assert torch.equal(_losses(FusedAdam), _losses(torch.optim.AdamW))
    assert torch.equal(_losses(FusedAdam, adam_w_mode=False), _losses(torch.optim.Adam))
    assert not torch.equal(_losses(FusedAdam, adam_w_mode=False), _losses(torch.optim.AdamW))


def test_cpu_adam_keeps_deepspeeds_adamw_default():
    """DeepSpeed 0.19.8's `DeepSpeedCPUAdam(adamw_mode=True)` default stays with DeepSpeed's
    name, while offload's `CPUAdam`, named after torch's class, defaults to torch's Adam."""
    assert issubclass(DeepSpeedCPUAdam, CPUAdam)
    adamw = _losses(CPUAdam, decoupled_weight_decay=True)
    torch.testing.assert_close(_losses(DeepSpeedCPUAdam), adamw, rtol=0, atol=0)
    torch.testing.assert_close(_losses(torch.optim.AdamW), adamw, rtol=1e-5, atol=1e-6)
    adam = _losses(CPUAdam)
    torch.testing.assert_close(_losses(DeepSpeedCPUAdam, adamw_mode=False), adam, rtol=0, atol=0)
    torch.testing.assert_close(_losses(torch.optim.Adam), adam, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(adam, adamw)


@pytest.mark.parametrize(
    ("cls", "kwargs", "word"),
    [
        (FusedAdam, {"amsgrad": True}, "amsgrad"),
        (FusedAdam, {"bias_correction": False}, "bias_correction"),
        (FusedAdam, {"set_grad_none": False}, "set_grad_none"),
        (DeepSpeedCPUAdam, {"fp32_optimizer_states": False}, "fp32_optimizer_states"),
    ],
)
def test_unsupported_arguments_are_named(cls, kwargs, word):
    with pytest.raises(ValueError, match=word):
        cls([nn.Parameter(torch.zeros(2))], **kwargs)


def _engine_losses(rank, world_size, given):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
    if given:
        optimizer = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    else:
        optimizer = None
        config["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True},
        }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    # how Lightning finds the engine's optimizer among a user's state (its load_checkpoint)
    assert isinstance(engine.optimizer, DeepSpeedOptimizer)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x = torch.randn(2, 4, generator=g)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_fused_adam_object_trains_as_the_configs_adamw():
    given = run_distributed(_engine_losses, world_size=2, args=(True,), timeout_s=120)
    by_name = run_distributed(_engine_losses, world_size=2, args=(False,), timeout_s=120)
    assert given == by_name
