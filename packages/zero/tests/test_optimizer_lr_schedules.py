"""LR schedulers drive the rates ZeRO actually steps with, with and without offload (issue 24 §1.0).

Plain PyTorch: AdamW in two param groups (weight decay 0.1 and 0), a torch scheduler stepped
after every optimizer step. ZeRO on 2 ranks, stages 1-3, `offload_optimizer` none / cpu / nvme:
the same model, groups and scheduler, attached either to the optimizer passed to `zero.shard`
(LambdaLR, a different schedule per group) or to the `ZeroOptimizer` itself (OneCycleLR, which
also cycles beta1). The losses must equal PyTorch's step by step.

Before the fix, offload copied each group's hyper-parameters into offload's CPU Adam once, so a
scheduler on the user's optimizer changed nothing (the losses drifted from the third step), and
`ZeroOptimizer` was not a `torch.optim.Optimizer`, so schedulers refused it (TypeError).
`state_dict` / `load_state_dict` then resume a run exactly, masters and schedule included. And
torch's "lr_scheduler.step() before optimizer.step()" warning stays silent under offload.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.testing import run_distributed

STEPS = 6
GLOBAL_BATCH = 8
LR = 1e-2
# LambdaLR factors per group: rates that jump around, so a frozen rate shows at once.
FACTORS = ([1.0, 0.2, 3.0, 0.05, 1.5, 0.5, 1.0], [1.0, 0.5, 0.25, 2.0, 0.1, 1.0, 1.0])


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Decay on matrices, none on vectors: two groups with different hyper-parameters."""
    ps = list(model.parameters())
    return [
        {"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
    ]


def scheduler(opt: torch.optim.Optimizer, kind: str):
    if kind == "lambda":
        lambdas = [lambda s, f=f: f[s] for f in FACTORS]
        return torch.optim.lr_scheduler.LambdaLR(opt, lambdas)
    if kind == "onecycle":  # lr and beta1 both follow the cycle
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS)
    assert kind == "none"
    return None


def reference_losses(kind: str) -> list[float]:
    """Single-process PyTorch on the global batches, with the scheduler ``kind``."""
    model = make_model()
    opt = torch.optim.AdamW(param_groups(model), lr=LR)
    sched = scheduler(opt, kind)
    losses = []
    for batch in make_batches(STEPS, GLOBAL_BATCH):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def ds_config(stage: int, device: str, nvme_path: str) -> zero.ZeroConfig:
    section: dict = {"stage": stage}
    if device == "nvme":
        nvme = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2, "pipeline_read": True}
        section.update(sub_group_size=3000, offload_optimizer=nvme)
        if stage == 3:  # ZeRO-Infinity: parameters, masters and states in files
            section.update(
                offload_param={"device": "nvme", "nvme_path": nvme_path, "buffer_size": 2000}
            )
    elif device == "cpu":
        section.update(offload_optimizer={"device": "cpu"})
    return zero.ZeroConfig.from_section(section)


def train(rank, world_size, config, attach: str, steps=range(STEPS), opt_and_sched=None):
    """Global losses of ``steps`` under zero.shard; the scheduler is attached to the user's
    optimizer (``attach='user'``, LambdaLR) or to the ZeroOptimizer (``'zero'``, OneCycleLR)."""
    if opt_and_sched is None:
        model = make_model()
        user = torch.optim.AdamW(param_groups(model), lr=LR)
        opt = zero.shard(model, user, config=config)
        sched = scheduler(user, "lambda") if attach == "user" else scheduler(opt, "onecycle")
    else:
        model, opt, sched = opt_and_sched
    batches = make_batches(STEPS, GLOBAL_BATCH)
    losses = []
    for k in steps:
        loss = model(*rank_slice(batches[k], rank, world_size))
        opt.backward(loss)
        assert opt.step()
        sched.step()
        total = loss.detach().reshape(1).clone()
        comm.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses, (model, opt, sched)


def _offload_installed() -> bool:
    """minispeed-offload is an optional extra of zero (`pip install packages/zero[offload]`)."""
    return importlib.util.find_spec("minispeed.offload") is not None


# The offload rows run where the extra is installed; zero alone checks the plain rows.
DEVICES = ("none", "cpu", "nvme") if _offload_installed() else ("none",)
_NEEDS_OFFLOAD = pytest.mark.skipif(
    not _offload_installed(), reason="needs minispeed-offload (packages/zero[offload])"
)


def _schedules(rank: int, world_size: int, stage: int, nvme_path: str) -> dict:
    out = {}
    for device in DEVICES:
        for attach in ("user", "zero"):
            config = ds_config(stage, device, nvme_path)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses, (_, opt, _) = train(rank, world_size, config, attach)
            order = [
                str(w.message) for w in caught if "before `optimizer.step()`" in str(w.message)
            ]
            out[device, attach] = (losses, type(opt.optimizer).__name__, order)
            opt.close()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_schedulers_change_the_rates_zero_steps_with(stage: int, tmp_path) -> None:
    per_rank = run_distributed(_schedules, args=(stage, str(tmp_path)), timeout_s=240)
    expected = {"user": reference_losses("lambda"), "zero": reference_losses("onecycle")}
    constant = reference_losses("none")
    for ref in expected.values():  # the schedules matter: a frozen rate would show
        assert max(abs(a - b) / b for a, b in zip(ref, constant)) > 1e-3
    inner = {"none": "AdamW", "cpu": "CPUAdam"}
    inner["nvme"] = "SwappedMastersOptimizer" if stage == 3 else "SwappedOptimizer"
    for (device, attach), (losses, kind, order) in per_rank[0].items():
        assert kind == inner[device]  # the offload path really ran
        assert not order, f"{device}, {attach}: torch warned that the optimizer never stepped"
        torch.testing.assert_close(
            losses, expected[attach], rtol=1e-5, atol=0, msg=f"{device}, {attach}"
        )
    assert per_rank[0] == per_rank[1]


def _resume(rank: int, world_size: int, stage: int, device: str, nvme_path: str) -> tuple:
    config = ds_config(stage, device, nvme_path)
    straight, state = train(rank, world_size, config, "zero", steps=range(3))
    _, opt, sched = state
    saved = copy.deepcopy(opt.state_dict())
    saved_sched = copy.deepcopy(sched.state_dict())
    rest, _ = train(rank, world_size, config, "zero", steps=range(3, STEPS), opt_and_sched=state)
    opt.close()
    # A second run from other weights and a fresh schedule, given the saved state.
    model = make_model(seed=7)
    opt = zero.shard(model, torch.optim.AdamW(param_groups(model), lr=LR), config=config)
    sched = scheduler(opt, "onecycle")
    opt.load_state_dict(saved)
    sched.load_state_dict(saved_sched)
    resumed, _ = train(
        rank, world_size, config, "zero", steps=range(3, STEPS), opt_and_sched=(model, opt, sched)
    )
    lrs = [pg["lr"] for pg in opt.param_groups]
    opt.close()
    return straight + rest, resumed, lrs


@pytest.mark.parametrize(
    "stage,device",
    [
        (1, "none"),
        pytest.param(2, "cpu", marks=_NEEDS_OFFLOAD),
        pytest.param(3, "nvme", marks=_NEEDS_OFFLOAD),
    ],
)
def test_state_dict_resumes_the_run(stage: int, device: str, tmp_path) -> None:
    per_rank = run_distributed(_resume, args=(stage, device, str(tmp_path)), timeout_s=180)
    full, resumed, lrs = per_rank[0]
    torch.testing.assert_close(full, reference_losses("onecycle"), rtol=1e-5, atol=0)
    assert resumed == full[3:]  # bit-identical: masters, moments, steps and rates restored
    assert lrs[0] == lrs[1] < LR
