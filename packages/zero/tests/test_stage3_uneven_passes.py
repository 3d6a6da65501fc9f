"""Ranks that run different numbers of forward passes get FetchOrderError, not a crash.

Evaluation with a different number of batches per rank (3 against 5 ``no_grad`` forwards) used
to pass every check (each forward follows the same trace) until one rank's training backward met
the other's evaluation forward inside gloo: a size mismatch that aborted a process. The default
check (``first``) now includes the grad mode in its one end-of-forward check, so the first pass
where the ranks differ (rank 0 trains, rank 1 still evaluates) raises on every rank, before the
backward's collectives. Even evaluation (4 and 4) then training is fine.
"""

from __future__ import annotations

import time

import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3 import FetchOrderError


def _run(rank: int, world_size: int, evals: int) -> dict:
    model = make_model()
    cfg = zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=0)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
    batches = [rank_slice(b, rank, world_size) for b in make_batches(3, 8)]
    t0 = time.monotonic()
    steps = 0
    try:
        opt.backward(model(*batches[0]))
        opt.step()
        with torch.no_grad():
            for _ in range(evals):
                model(*batches[1])
        for batch in batches[1:]:
            opt.backward(model(*batch))
            opt.step()
            steps += 1
    except FetchOrderError as err:
        return dict(error=str(err), steps=steps, seconds=time.monotonic() - t0)
    return dict(error=None, steps=steps)


def _body(rank: int, world_size: int) -> dict:
    return dict(
        uneven=_run(rank, world_size, 3 if rank == 0 else 5),
        even=_run(rank, world_size, 4),
    )


def test_uneven_evaluation_raises_on_every_rank() -> None:
    results = run_distributed(_body, world_size=2, timeout_s=120)
    for rank, res in enumerate(results):
        got = res["uneven"]
        assert got["error"] is not None, f"rank {rank} did not raise"
        assert got["steps"] == 0 and got["seconds"] < 30, got
        assert "no_grad" in got["error"] and "same number" in got["error"], got["error"]
        assert res["even"] == dict(error=None, steps=2)
