"""Ranks that run modules in different orders get a clear error on every rank, not a hang.

RankBranchNet runs ``branch_b`` on odd ranks and ``branch_a`` on even ones when ``mode == "rank"``.
Cases, one distributed run:

1. divergent from the first step (trace being recorded): caught by the per-module check;
2. divergent from step 3 (trace followed, default mode): the diverging rank replays the trace's
   collectives and everyone raises at the end-of-forward check;
3. the same at step 3 in the debug mode ``every``: caught at the module itself;
4. every rank switches branch together at step 3: legitimate; re-traced, and the losses still equal
   single-process PyTorch.
"""

from __future__ import annotations

import time

import torch
from stage3_testlib import RankBranchNet, global_loss

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3 import FetchOrderError

ROWS = 8


def _data() -> torch.Tensor:
    return torch.randn(ROWS, 8, generator=torch.Generator().manual_seed(3))


def _train(rank: int, world_size: int, modes: list[str], check: str) -> dict:
    torch.manual_seed(0)
    model = RankBranchNet()
    cfg = zero.ZeroConfig(
        stage=3, stage3_param_persistence_threshold_numel=0, stage3_trace_check=check
    )
    opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    n = ROWS // world_size
    x = _data()[rank * n : (rank + 1) * n]
    losses: list[float] = []
    t0 = time.monotonic()
    try:
        for mode in modes:
            model.mode = mode
            loss = model(x)
            losses.append(global_loss(loss, world_size))
            opt.backward(loss)
            opt.step()
    except FetchOrderError as err:
        return dict(losses=losses, error=str(err), seconds=time.monotonic() - t0)
    return dict(losses=losses, error=None, retraces=opt.strategy.coordinator.stats.retraces)


def _body(rank: int, world_size: int) -> dict:
    return {
        "first_step": _train(rank, world_size, ["rank", "a"], "first"),
        "later_step": _train(rank, world_size, ["a", "a", "rank", "a"], "first"),
        "later_step_debug": _train(rank, world_size, ["a", "a", "rank", "a"], "every"),
        "all_switch": _train(rank, world_size, ["a", "a", "b", "b", "b"], "first"),
    }


def _reference(modes: list[str]) -> list[float]:
    torch.manual_seed(0)
    model = RankBranchNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for mode in modes:
        model.mode = mode
        loss = model(_data())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def test_divergent_module_order_raises_on_every_rank() -> None:
    results = run_distributed(_body, world_size=2, timeout_s=120)
    for case, steps_done in (("first_step", 0), ("later_step", 2), ("later_step_debug", 2)):
        for rank, res in enumerate(results):
            got = res[case]
            assert got["error"] is not None, f"{case}: rank {rank} did not raise"
            assert len(got["losses"]) == steps_done, (case, rank, got["losses"])
            assert "'branch_a'" in got["error"] and "'branch_b'" in got["error"], got["error"]
            assert "set_leaf_module" in got["error"]
            assert got["seconds"] < 30, f"{case}: rank {rank} took {got['seconds']:.1f}s to raise"
    want = _reference(["a", "a", "b", "b", "b"])
    for res in results:
        got = res["all_switch"]
        assert got["error"] is None and got["retraces"] == 1
        for a, b in zip(got["losses"], want, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (got["losses"], want)
