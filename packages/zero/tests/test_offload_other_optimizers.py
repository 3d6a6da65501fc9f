"""Adagrad and Lion are offloaded through `zero.shard` too, equal to un-offloaded training
(issue 24 §4), and Adam stays Adam (L2): torch's Adagrad is stepped by offload's `CPUAdagrad`, a Lion (`CPULion`; torch
has no Lion class) by `CPULion`, each over the user's own param groups. 2 ranks, stages 2-3,
`offload_optimizer: cpu`, TinyGPT losses vs single-process PyTorch (Lion's reference update is
written out here in plain torch). Before, `zero.shard` refused both ("must be torch.optim.Adam
or AdamW"). With `nvme`, which swaps Adam's two states, they are refused by name.
"""

from __future__ import annotations

import pytest
import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.testing import run_distributed

offload = pytest.importorskip("minispeed.offload")

STEPS, GLOBAL_BATCH = 8, 8
ADAGRAD = dict(lr=5e-2, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1)
LION = dict(lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)


class ReferenceLion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) in plain torch, for the single-process reference only."""

    def __init__(self, params, lr, betas, weight_decay) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = (b1 * m + (1 - b1) * p.grad).sign()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def make_optimizer(kind: str, params, reference: bool) -> torch.optim.Optimizer:
    if kind == "adam":  # L2 weight decay: the user's Adam must not be stepped as AdamW
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.1)
    if kind == "adagrad":
        return torch.optim.Adagrad(params, **ADAGRAD)
    return (ReferenceLion if reference else offload.CPULion)(params, **LION)


def reference_losses(kind: str) -> list[float]:
    model = make_model()
    opt = make_optimizer(kind, model.parameters(), reference=True)
    losses = []
    for batch in make_batches(STEPS, GLOBAL_BATCH):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train(rank: int, world_size: int, stage: int, kind: str, root: str) -> dict:
    out: dict = {}
    for device in ("cpu", "nvme"):
        section = {"stage": stage, "offload_optimizer": {"device": device, "nvme_path": root}}
        config = zero.ZeroConfig.from_section(section)
        model = make_model()
        try:
            opt = zero.shard(model, make_optimizer(kind, model.parameters(), False), config=config)
        except (RuntimeError, ValueError) as exc:
            out[device] = f"{type(exc).__name__}: {exc}"
            continue
        losses = []
        for batch in make_batches(STEPS, GLOBAL_BATCH):
            loss = model(*rank_slice(batch, rank, world_size))
            opt.backward(loss)
            opt.step()
            total = loss.detach().reshape(1).clone()
            comm.all_reduce(total)
            losses.append(total.item() / world_size)
        out[device] = (losses, type(opt.optimizer).__name__)
        opt.close()
    return out


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("kind", ["adam", "adagrad", "lion"])
def test_adagrad_and_lion_offload_equal_plain_training(kind: str, stage: int, tmp_path) -> None:
    per_rank = run_distributed(_train, args=(stage, kind, str(tmp_path)), timeout_s=180)
    assert isinstance(per_rank[0]["cpu"], tuple), per_rank[0]["cpu"]
    losses, inner = per_rank[0]["cpu"]
    assert inner == {"adam": "CPUAdam", "adagrad": "CPUAdagrad", "lion": "CPULion"}[kind]
    ref = reference_losses(kind)
    assert ref[-1] < 0.97 * ref[0]  # it trains
    torch.testing.assert_close(losses, ref, rtol=1e-5, atol=0)
    if kind == "adam":  # the swapped optimizers keep Adam's L2 mode too
        torch.testing.assert_close(per_rank[0]["nvme"][0], ref, rtol=1e-5, atol=0)
        return
    for res in per_rank:
        assert "swaps Adam's states only" in res["nvme"], res["nvme"]
        assert "device 'cpu'" in res["nvme"], res["nvme"]
