"""CPUAdam/CPUAdamW/CPUAdagrad/CPULion are torch.optim optimizers: same state_dict, both ways."""

from __future__ import annotations

import io

import pytest
import torch

from minispeed.offload import CPUAdagrad, CPUAdam, CPUAdamW, CPULion

PAIRS = [
    (torch.optim.Adam, CPUAdam, dict(lr=1e-2, weight_decay=0.01)),
    (torch.optim.AdamW, CPUAdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adagrad, CPUAdagrad, dict(lr=1e-2, lr_decay=0.01, initial_accumulator_value=0.1)),
]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 13, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _saved(opt: torch.optim.Optimizer) -> dict:
    """The state_dict as it comes back from a checkpoint file (no tensor shared with ``opt``)."""
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf)


def _close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("torch_cls,our_cls,kw", PAIRS, ids=["adam", "adamw", "adagrad"])
def test_checkpoint_moves_from_torch_to_ours_and_back(torch_cls, our_cls, kw) -> None:
    # torch trains 5 steps, saves; ours loads and trains 5 more; torch continues alike.
    a, b = _model(0), _model(0)
    opt_a = torch_cls(a.parameters(), **kw)
    _train(a, opt_a, 5, seed=1)
    b.load_state_dict(a.state_dict())
    ours = our_cls(b.parameters(), **kw)
    ours.load_state_dict(_saved(opt_a))
    _train(a, opt_a, 5, seed=2)
    _train(b, ours, 5, seed=2)
    _close(a, b)
    # ... and back: ours saves, a fresh torch optimizer loads and continues.
    saved = _saved(ours)
    assert saved["param_groups"] == opt_a.state_dict()["param_groups"]
    back = torch_cls(b.parameters(), **kw)
    back.load_state_dict(saved)
    _train(a, opt_a, 3, seed=3)
    _train(b, back, 3, seed=3)
    _close(a, b)
    for key, value in opt_a.state_dict()["state"][0].items():
        assert value.dtype == saved["state"][0][key].dtype, key


def test_write_back_through_the_optimizer_emits_bf16_weights() -> None:
    model = _model(0)
    opt = CPUAdamW(model.parameters(), lr=1e-2)
    outs = [torch.empty_like(p, dtype=torch.bfloat16) for p in model.parameters()]
    model(torch.randn(4, 13)).sum().backward()
    opt.step(write_back=outs)
    for p, out in zip(model.parameters(), outs):
        assert torch.equal(out, p.detach().to(torch.bfloat16))


def test_lion_state_dict_round_trips() -> None:
    a, b = _model(0), _model(0)
    opt_a = CPULion(a.parameters(), lr=1e-3, weight_decay=0.1)
    _train(a, opt_a, 3, seed=1)
    b.load_state_dict(a.state_dict())
    opt_b = CPULion(b.parameters(), lr=1e-3, weight_decay=0.1)
    opt_b.load_state_dict(_saved(opt_a))
    _train(a, opt_a, 3, seed=2)
    _train(b, opt_b, 3, seed=2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_unsupported_options_are_refused_by_name() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam(params, amsgrad=True)
    with pytest.raises(TypeError, match="fp32 CPU parameters"):
        CPUAdam([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))])
    # A torch checkpoint saved with amsgrad=True cannot be continued by ours: said at step().
    torch_opt = torch.optim.Adam(params, amsgrad=True)
    ours = CPUAdam(params)
    ours.load_state_dict(_saved(torch_opt))
    params[0].grad = torch.ones(3)
    with pytest.raises(ValueError, match="amsgrad"):
        ours.step()
