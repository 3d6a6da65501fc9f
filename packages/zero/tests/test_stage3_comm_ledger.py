"""Stage 3's bytes per step, measured by the comms logger, equal ``stage3_step_bytes`` exactly.

Forward all-gathers Ψ_np, backward all-gathers Ψ_np again, the reduce-scatter moves Ψ (every
parameter that got a gradient), persistent parameters are all-gathered once after the optimizer
step, and one 3-int64 all-gather per forward checks the fetch order. Ψ counts padded elements
(``N·ceil(n/N)`` per parameter). With one rank nothing is re-gathered after the step (the shard
is the whole value) and there is no order check.
"""

from __future__ import annotations

import pytest
import torch
from stage3_testlib import GLOBAL_BATCH, LR
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3 import stage3_step_bytes

THRESHOLD = 30  # layer norms, small biases, shared_gain and `unused` are persistent
GATHERS = ("all_gather", "all_gather_coalesced")


def _bytes(log: comm.CommsLogger, ops: tuple[str, ...], dtype: str) -> int:
    return sum(r.msg_bytes for r in log.records if r.op in ops and r.dtype == dtype)


def _body(rank: int, world_size: int) -> dict:
    model = make_model()
    cfg = zero.ZeroConfig(stage=3, stage3_param_persistence_threshold_numel=THRESHOLD)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
    batches = [rank_slice(b, rank, world_size) for b in make_batches(3, GLOBAL_BATCH)]
    for batch in batches[:2]:  # step 1 records the trace; step 2 is already steady
        opt.backward(model(*batch))
        opt.step()
    with comm.CommsLogger() as fwd:
        loss = model(*batches[2])
    with comm.CommsLogger() as bwd:
        opt.backward(loss)
    with comm.CommsLogger() as step:
        assert opt.step()
    f32 = "torch.float32"
    return dict(
        forward_all_gather=_bytes(fwd, GATHERS, f32),
        trace_check=_bytes(fwd, GATHERS, "torch.int64"),
        backward_all_gather=_bytes(bwd, GATHERS, f32),
        reduce_scatter=_bytes(bwd, ("reduce_scatter",), f32),
        persistent_all_gather=_bytes(step, GATHERS, f32),
        other_in_forward=[r.op for r in fwd.records if r.op not in GATHERS],
        other_in_backward=[r.op for r in bwd.records if r.op not in (*GATHERS, "reduce_scatter")],
    )


@pytest.mark.parametrize("world_size", [1, 2, 4], ids=["ws1", "ws2", "ws4"])
def test_stage3_bytes_per_step_match_the_formula(world_size: int) -> None:
    names_numels = [(n, p.numel()) for n, p in make_model().named_parameters()]
    numels = [n for _, n in names_numels]
    # `unused` is reduce-scattered too, as zeros: Note [a fixed bucket plan] (stage3/strategy.py).
    want = stage3_step_bytes(
        numels, world_size, persistence_threshold_numel=THRESHOLD, param_bytes=4, grad_bytes=4
    )
    results = run_distributed(_body, world_size=world_size, timeout_s=180)
    for rank, got in enumerate(results):
        assert got["other_in_forward"] == [] and got["other_in_backward"] == [], got
        for field in (
            "forward_all_gather",
            "backward_all_gather",
            "reduce_scatter",
            "trace_check",
            "persistent_all_gather",
        ):
            assert got[field] == getattr(want, field), (rank, field, got[field], want)
    # The headline: ≈ 3Ψ elements per micro-step (padding and persistent parameters aside).
    psi = sum(numels)
    per_step = want.forward_all_gather + want.backward_all_gather + want.reduce_scatter
    assert 2.9 * psi * 4 < per_step < 3.05 * psi * 4
