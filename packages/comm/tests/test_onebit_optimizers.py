"""1-bit Adam and 1-bit LAMB on 2 and 4 gloo ranks against single-process PyTorch.

- numerics: the warm-up phase is exactly Adam (``torch.optim.Adam``) / LAMB on the global batch;
- communication: a warm-up step sends one fp32 all-reduce, a compressed step the 1-bit bytes;
- convergence: after the same steps, the 1-bit optimizers reach a loss within 5 % of their
  uncompressed counterparts (a tiny MLP regression, 200 steps);
- checkpoints: state_dict round trip keeps the phase and the moments.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import minispeed.comm as comm
from minispeed.comm.compression import ops, wire
from minispeed.comm.optim import OnebitAdam, OnebitLamb, OnebitPhase
from minispeed.core.testing import run_distributed

STEPS, FREEZE, LR, BATCH = 200, 50, 0.03, 64


@pytest.fixture(scope="module", autouse=True)
def _built_once():
    """Build (or load) the op in the parent first, so ranks import the cached .so in parallel."""
    ops.load_op("cpu")


def _dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """1024 samples of a noisy random tanh network (noise variance 0.09: the loss floor)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    w1, w2 = torch.randn(8, 16, generator=g), torch.randn(16, 1, generator=g) / 4
    return x, torch.tanh(x @ w1) @ w2 + 0.3 * torch.randn(1024, 1, generator=g)


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _make(name: str, params, freeze_step: int):
    if name == "adam":
        return torch.optim.Adam(params, lr=LR)
    cls = OnebitAdam if name == "onebit_adam" else OnebitLamb
    return cls(params, lr=LR, freeze_step=freeze_step)


def _train(name: str, steps: int, freeze_step: int, rank: int = 0, world_size: int = 1) -> dict:
    """Train on the same global batches; each rank takes its slice of every batch."""
    x, y = _dataset()
    model = _model()
    opt = _make(name, model.parameters(), freeze_step)
    batches = torch.Generator().manual_seed(2)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (BATCH,), generator=batches)
        xb, yb = x[idx].chunk(world_size)[rank], y[idx].chunk(world_size)[rank]
        opt.zero_grad()
        F.mse_loss(model(xb), yb).backward()
        opt.step()
    with torch.no_grad():
        loss = float(F.mse_loss(model(x), y))
    return {"loss": loss, "params": [p.detach().clone() for p in model.parameters()]}


def _train_body(rank: int, world_size: int, name: str, steps: int, freeze_step: int) -> dict:
    return _train(name, steps, freeze_step, rank, world_size)


def _lamb_reference(steps: int) -> list[torch.Tensor]:
    """Plain single-process LAMB with Adam's bias correction (what OnebitLamb's warm-up is)."""
    x, y = _dataset()
    model = _model()
    state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in model.parameters()]
    batches = torch.Generator().manual_seed(2)
    for t in range(1, steps + 1):
        idx = torch.randint(0, x.shape[0], (BATCH,), generator=batches)
        model.zero_grad()
        F.mse_loss(model(x[idx]), y[idx]).backward()
        with torch.no_grad():
            for p, (m, v) in zip(model.parameters(), state):
                m.mul_(0.9).add_(p.grad, alpha=0.1)
                v.mul_(0.999).add_(p.grad**2, alpha=0.001)
                u = (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
                trust = min(max(float(p.norm() / u.norm()), 0.01), 10.0)
                p.sub_(LR * trust * u)
    return [p.detach() for p in model.parameters()]


# -- numerics -----------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
def test_onebit_adam_warmup_is_torch_adam_on_the_global_batch(world_size):
    results = run_distributed(
        _train_body, world_size=world_size, args=("onebit_adam", 10, 1000), timeout_s=120
    )
    expected = _train("adam", 10, 0)["params"]
    for res in results:
        for got, want in zip(res["params"], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_onebit_lamb_warmup_is_lamb_on_the_global_batch():
    results = run_distributed(
        _train_body, world_size=2, args=("onebit_lamb", 10, 1000), timeout_s=120
    )
    for got, want in zip(results[0]["params"], _lamb_reference(10)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- communication --------------------------------------------------------------------------------
def _bytes_per_step(rank: int, world_size: int, name: str) -> list[list[tuple[str, int]]]:
    x, y = _dataset()
    model = _model()
    opt = _make(name, model.parameters(), freeze_step=2)
    per_step = []
    for step in range(4):
        opt.zero_grad()
        F.mse_loss(model(x[:8]), y[:8]).backward()
        with comm.CommsLogger() as log:
            opt.step()
        per_step.append([(r.op, r.msg_bytes) for r in log.records])
        assert opt.phase is (OnebitPhase.WARMUP if step < 1 else OnebitPhase.COMPRESSED)
    return per_step


@pytest.mark.parametrize("name", ["onebit_adam", "onebit_lamb"])
def test_warmup_sends_fp32_then_compressed_steps_send_one_bit(name):
    per_step = run_distributed(_bytes_per_step, world_size=2, args=(name,), timeout_s=120)[0]
    numel = sum(p.numel() for p in _model().parameters())
    dense = wire.dense_allreduce_calls(numel, 2)
    onebit = wire.onebit_allreduce_calls(numel, 2)
    assert per_step == [dense, dense, onebit, onebit]  # freeze_step=2: steps 1-2 warm up
    assert (
        wire.wire_bytes(dense, 2) / wire.wire_bytes(onebit, 2) > 15
    )  # 321 parameters, so C is small


# -- convergence ----------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
def test_onebit_adam_loss_is_within_5_percent_of_adam(world_size):
    results = run_distributed(
        _train_body, world_size=world_size, args=("onebit_adam", STEPS, FREEZE), timeout_s=120
    )
    adam = _train("adam", STEPS, 0)["loss"]
    assert results[0]["loss"] <= 1.05 * adam, (results[0]["loss"], adam)
    assert all(r["loss"] == results[0]["loss"] for r in results)  # ranks stay in sync


def test_onebit_lamb_loss_is_within_5_percent_of_lamb():
    results = run_distributed(
        _train_body, world_size=2, args=("onebit_lamb", STEPS, FREEZE), timeout_s=120
    )
    lamb = _train("onebit_lamb", STEPS, freeze_step=10**9)["loss"]  # never compresses
    assert results[0]["loss"] <= 1.05 * lamb, (results[0]["loss"], lamb)


# -- checkpoints and configuration ---------------------------------------------------------------
@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb])
def test_state_dict_round_trip_keeps_phase_and_moments(cls):
    x, y = _dataset()
    model = _model()
    opt = cls(model.parameters(), lr=LR, freeze_step=3)
    for _ in range(5):  # single process, no group: communication is skipped
        opt.zero_grad()
        F.mse_loss(model(x[:16]), y[:16]).backward()
        opt.step()
    assert opt.phase is OnebitPhase.COMPRESSED
    saved = opt.state_dict()
    fresh = cls(_model().parameters(), lr=LR, freeze_step=3)
    fresh.load_state_dict(saved)
    assert fresh.phase is OnebitPhase.COMPRESSED and fresh.steps_taken == 5
    for p_old, p_new in zip(model.parameters(), fresh.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p_old][key], fresh.state[p_new][key])
    with pytest.raises(ValueError, match="not saved by a 1-bit optimizer"):
        fresh.load_state_dict(torch.optim.Adam(model.parameters()).state_dict())


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb])
def test_a_warmup_checkpoint_rewinds_a_compressed_optimizer_to_warmup(cls):
    # The schedule's one backward move: the loaded optimizer then steps as a fresh one loaded
    # with the same checkpoint (its gradients averaged in fp32 again, v no longer frozen).
    x, y = _dataset()
    models = [_model(), _model()]
    opts = [cls(m.parameters(), lr=LR, freeze_step=3) for m in models]

    def step(model, opt) -> None:
        opt.zero_grad()
        F.mse_loss(model(x[:16]), y[:16]).backward()
        opt.step()

    step(models[0], opts[0])
    early = copy.deepcopy(opts[0].state_dict())  # step 1 of 3: warm-up (state is by reference)
    weights = {k: v.clone() for k, v in models[0].state_dict().items()}
    for _ in range(4):
        step(models[0], opts[0])
    assert opts[0].phase is OnebitPhase.COMPRESSED
    for model, opt in zip(models, opts):
        model.load_state_dict(weights)
        opt.load_state_dict(copy.deepcopy(early))  # load_state_dict keeps the tensors given
        assert opt.phase is OnebitPhase.WARMUP and opt.steps_taken == 1
    for _ in range(3):
        for model, opt in zip(models, opts):
            step(model, opt)
    assert all(opt.phase is OnebitPhase.COMPRESSED for opt in opts)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)


def test_bad_hyper_parameters_name_the_fix():
    params = _model().parameters()
    with pytest.raises(ValueError, match="freeze_step must be a positive int"):
        OnebitAdam(params, freeze_step=0)
    with pytest.raises(ValueError, match="betas"):
        OnebitAdam(_model().parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="factor_min <= 1 <= factor_max"):
        OnebitLamb(_model().parameters(), factor_max=0.9)
