"""`CPUAdam` has DeepSpeed's `DeepSpeedCPUAdam` defaults: AdamW unless ``adamw_mode=False``, and
``bias_correction`` (issue 24 §4). Compared with torch.optim.AdamW / Adam and, for
``bias_correction=False``, with the update written out here in plain torch."""

from __future__ import annotations

import pytest
import torch

from minispeed.offload import CPUAdam

LR, WD = 1e-2, 0.1


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (1000, 37)]


def _run(opt: torch.optim.Optimizer, params, steps: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize(
    "kwargs,torch_cls",
    [
        ({}, torch.optim.AdamW),  # the default: DeepSpeedCPUAdam's adamw_mode=True
        ({"adamw_mode": True}, torch.optim.AdamW),
        ({"adamw_mode": False}, torch.optim.Adam),
        ({"decoupled_weight_decay": False}, torch.optim.Adam),  # torch's name for the switch
    ],
)
def test_adamw_mode_picks_the_weight_decay(kwargs, torch_cls) -> None:
    ours, ref = _params(), _params()
    got = _run(CPUAdam(ours, lr=LR, weight_decay=WD, **kwargs), ours)
    want = _run(torch_cls(ref, lr=LR, weight_decay=WD), ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    other = torch.optim.Adam if torch_cls is torch.optim.AdamW else torch.optim.AdamW
    ref = _params()
    assert not torch.allclose(got[0], _run(other(ref, lr=LR, weight_decay=WD), ref)[0])


def test_bias_correction_off_steps_with_the_raw_moments() -> None:
    ours = _params()
    got = _run(CPUAdam(ours, lr=LR, weight_decay=WD, bias_correction=False), ours)
    b1, b2, eps = 0.9, 0.999, 1e-8
    g = torch.Generator().manual_seed(1)
    ps = [p.detach().clone() for p in _params()]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for _ in range(5):
        for p, m, v in zip(ps, ms, vs):
            grad = torch.randn(p.shape, generator=g)
            p.mul_(1 - LR * WD)
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            p.sub_(LR * m / (v.sqrt() + eps))
    for a, b in zip(got, ps):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_both_names_given_differently_is_an_error() -> None:
    with pytest.raises(ValueError, match="same switch"):
        CPUAdam(_params(), adamw_mode=True, decoupled_weight_decay=False)
