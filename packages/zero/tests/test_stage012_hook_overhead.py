"""The Python that stages 0-2 run per gradient, counted: what a small model pays over PyTorch DDP,
whose reducer runs its hooks in C++ (issue 34 point 5: ZeRO-0 ≤ 1.05× DDP's CPU time at 30K
parameters, where a micro-step is per-call overhead).

Each parameter's gradient passes through two hooks: the reducer's (`weak_hook` → `_on_grad` →
its slot → `LaunchQueue.arrived`) and the optimizer's used-parameter mark (Note [unused
parameters] in optimizer.py). Counted as Python function calls (`sys.setprofile`'s `call`
events, deterministic where times on a shared machine are not) during `ZeroOptimizer.backward`
minus those of a plain `loss.backward()` of the same model, per parameter: the fixed cost of a
backward (the window's bookkeeping) is spread over 64 parameters.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

LAYERS, GAS = 32, 2  # 64 parameters
# Per parameter per micro-step: the reducer's hook, `_on_grad`, `_slot`, `arrived`, the used mark
# (5), plus the backward's fixed bookkeeping spread over the parameters: 6.0, 6.3 and 7.2 at
# stages 0, 1 and 2 (stage 2 launches a bucket per parameter here). 13.4, 13.7 and 15.1 when
# the hooks went through `weakref.WeakMethod`, looked the parameter up in dicts and sets (a
# tensor's `__hash__` is a Python call) and asked the schedule whether to launch, and the
# queue whether a bucket was ready, at every gradient.
BUDGET_PER_PARAM = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(LAYERS)))


def _calls(run) -> int:
    calls = 0

    def profile(frame, event, arg) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def _per_param(rank: int, world_size: int, stage: int) -> float:
    x = torch.randn(2, 4)
    plain = _model()
    plain(x).sum().backward()  # warm-up: autograd's lazy state
    base = _calls(lambda: plain(x).sum().backward())
    model = _model()
    opt = zero.shard(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        config=zero.ZeroConfig(stage=stage, gradient_accumulation_steps=GAS),
    )
    for _ in range(GAS):  # warm-up window
        opt.backward(model(x).sum())
        opt.step()
    counted = 0
    for _ in range(GAS):  # one window: a micro-step that accumulates, one that reduces
        loss = model(x).sum()
        counted += _calls(lambda loss=loss: opt.backward(loss))
        opt.step()
    # The forward is outside the count; `base` counted one forward and one backward.
    forward = _calls(lambda: plain(x))
    params = sum(1 for _ in model.parameters())
    return (counted / GAS - (base - forward)) / params


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradient_hooks_run_few_python_calls_per_parameter(stage: int) -> None:
    per_param = run_distributed(_per_param, world_size=1, args=(stage,), timeout_s=60)[0]
    assert per_param <= BUDGET_PER_PARAM, (
        f"stage {stage}: {per_param:.2f} Python calls per parameter per micro-step in the "
        f"gradient hooks (budget {BUDGET_PER_PARAM}): a lookup keyed by the parameter, a "
        f"WeakMethod or a per-gradient decision crept back onto the hook's path"
    )
