"""The all-to-alls of one MoE step send the bytes `costs.all_to_all_bytes` predicts.

Dropping: 4 equal-split calls per step (dispatch and combine, forward and backward), each
(E_p − 1)/E_p · E·C·d·4 bytes. No dropping: one exchange of the E counts, then 4 uneven calls;
the dispatch sends every kept row bound for another rank.
"""

from __future__ import annotations

from _models import HIDDEN, NUM_EXPERTS, batch, build, config, loss_of

import minispeed.comm as comm
import minispeed.moe as moe
from minispeed.core.testing import run_distributed


def _one_step_records(rank: int, world_size: int) -> dict:
    groups = moe.ExpertGroups(world_size)
    out = {}
    for drop in (True, False):
        model = build(config(world_size, drop), groups)
        x, y = batch(0, rank)
        with comm.CommsLogger() as log:
            loss_of(model, x, y).backward()
        r = model.mlp.last_routing
        calls = [(rec.numel, rec.wire_bytes, rec.dtype) for rec in log.filter(op="all_to_all")]
        out[drop] = (calls, r.capacity, r.kept_counts.tolist())
    return out


def test_all_to_all_bytes_match_the_formula():
    world = 2
    results = run_distributed(_one_step_records, world_size=world)
    e_local = NUM_EXPERTS // world
    for rank, res in enumerate(results):
        calls, cap, _ = res[True]
        assert len(calls) == 4
        rows_each = [e_local * cap] * world
        want = moe.all_to_all_bytes(rows_each, rank, HIDDEN * 4)
        assert want == (world - 1) * NUM_EXPERTS * cap * HIDDEN * 4 // world
        assert [c[1] for c in calls] == [want] * 4
        calls, cap, kept = res[False]
        assert cap is None and len(calls) == 5
        assert calls[0][2] == "torch.int64" and calls[0][0] == NUM_EXPERTS  # the counts
        rows_to = [sum(kept[j * e_local : (j + 1) * e_local]) for j in range(world)]
        assert calls[1][1] == moe.all_to_all_bytes(rows_to, rank, HIDDEN * 4)
        assert calls[1][0] == sum(kept) * HIDDEN  # every kept row leaves once
