"""A CPU optimizer named after a torch class behaves like it by default (issue 32 §4): `CPUAdam`
is ``torch.optim.Adam`` (L2 weight decay), `CPUAdamW` is ``torch.optim.AdamW``, at every SIMD
path this build has and in the reference; ``decoupled_weight_decay`` switches `CPUAdam` as it
switches torch's Adam. ``bias_correction=False`` is compared with the update written out here
in plain torch. (DeepSpeed's ``DeepSpeedCPUAdam`` keeps DeepSpeed's AdamW default: tested with
its adapter in tests/engine/test_adapters_ops_accelerator.py.)"""

from __future__ import annotations

import pytest
import torch

from minispeed.offload import CPUAdam, CPUAdamW

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


def _simd(path: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    """`CPUAdam`'s arguments for `path` (conftest: simd<level> or the reference)."""
    if path == "reference":
        monkeypatch.setenv("MINISPEED_DISABLE_OPS", "offload")
        return {}
    return {"simd": int(path.removeprefix("simd"))}


@pytest.mark.parametrize(
    "ours_cls,kwargs,torch_cls,torch_kwargs",
    [
        (CPUAdam, {}, torch.optim.Adam, {}),  # the default: torch's Adam
        (CPUAdam, {"decoupled_weight_decay": True}, torch.optim.AdamW, {}),
        (CPUAdam, {"decoupled_weight_decay": True}, torch.optim.Adam,
         {"decoupled_weight_decay": True}),  # torch's own switch, the same rule
        (CPUAdamW, {}, torch.optim.AdamW, {}),
    ],
    ids=["CPUAdam", "CPUAdam-decoupled", "CPUAdam-decoupled-as-torch-Adam", "CPUAdamW"],
)  # fmt: skip
def test_named_after_torch_steps_like_torch(
    ours_cls, kwargs, torch_cls, torch_kwargs, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, ref = _params(), _params()
    opt = ours_cls(ours, lr=LR, weight_decay=WD, **kwargs, **_simd(path, monkeypatch))
    got = _run(opt, ours)
    want = _run(torch_cls(ref, lr=LR, weight_decay=WD, **torch_kwargs), ref)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # ... and the other rule gives a different model, so the comparison can fail.
    decoupled = opt.param_groups[0]["decoupled_weight_decay"]
    other = torch.optim.Adam if decoupled else torch.optim.AdamW
    ref = _params()
    assert not torch.allclose(got[0], _run(other(ref, lr=LR, weight_decay=WD), ref)[0])


def test_defaults_are_torchs() -> None:
    """Every default `CPUAdam` / `CPUAdamW` stores in its param groups is the torch class's."""
    for ours, theirs in ((CPUAdam, torch.optim.Adam), (CPUAdamW, torch.optim.AdamW)):
        got = ours(_params()).defaults
        want = theirs(_params()).defaults
        assert {k: got[k] for k in want} == want, ours.__name__


def test_bias_correction_off_steps_with_the_raw_moments() -> None:
    ours = _params()
    opt = CPUAdam(ours, lr=LR, weight_decay=WD, bias_correction=False, decoupled_weight_decay=True)
    got = _run(opt, ours)
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
