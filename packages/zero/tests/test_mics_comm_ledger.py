"""MiCS's bytes per micro-step, measured by the comms logger per axis, equal the formula; against
plain ZeRO-3 and hpZ on the same 4 gloo ranks as 2 "nodes" × 2 (``LOCAL_WORLD_SIZE=2``, S = 2).

Axes (`axis_of`, node = 2 ranks = a MiCS shard group): ``intra`` (a node), ``inter`` (one rank
per node), ``world``. Expected per micro-step: plain ZeRO-3 gathers and reduce-scatters on the
world; hpZ moves backward's gather into the node; MiCS keeps every gather and reduce-scatter in
the node and sends only the gradients' all-reduce across (`mics_step_bytes`). Memory: each rank
holds Ψ/S of the model states, not Ψ/N (`zero.memory.predict` against `zero.memory.measure`).
`mics_hierarchical_params_gather` with one shard group over both nodes (S = 4) gathers in two
levels, inside each node then across, and trains exactly as plain ZeRO-3.
"""

from __future__ import annotations

from zero_testlib import make_batches, make_model, rank_slice
from zeropp_testlib import GLOBAL_BATCH, NODE_SIZE, THRESHOLD, build, emulate_nodes

import minispeed.comm as comm
from minispeed.core.testing import run_distributed
from minispeed.zero.memory import measure, padding_allowance, predict
from minispeed.zero.stage3 import (
    bytes_by_axis,
    cross_node_bytes,
    mics_step_bytes,
    zeropp_step_bytes,
)

WORLD = 4
KINDS = {
    "ZeRO-3": (False, False, False),
    "hpZ": (False, True, False),
    "MiCS": (False, False, False),
    "MiCS S=4, hierarchical": (False, False, False),  # one group of both nodes: two-level gathers
}
EXTRA = {
    "MiCS": {"mics_shard_size": NODE_SIZE},
    "MiCS S=4, hierarchical": {"mics_shard_size": 4, "mics_hierarchical_params_gather": True},
}


def _body(rank: int, world_size: int) -> dict:
    emulate_nodes()
    out = {}
    for kind, combo in KINDS.items():
        model, opt = build(combo, **EXTRA.get(kind, {}))
        batches = [rank_slice(b, rank, world_size) for b in make_batches(3, GLOBAL_BATCH)]
        losses = []
        for batch in batches[:2]:  # step 1 records the trace; step 2 is steady
            loss = model(*batch)
            losses.append(loss.item())
            opt.backward(loss)
            opt.step()
        with comm.CommsLogger() as fwd:
            loss = model(*batches[2])
        with comm.CommsLogger() as bwd:
            opt.backward(loss)
        held = measure(opt, model)  # at the boundary: every model state exists
        opt.step()
        records = [r for r in fwd.records + bwd.records if r.dtype != "torch.int64"]
        out[kind] = {
            "forward": bytes_by_axis(fwd.records, NODE_SIZE),
            "backward": bytes_by_axis(bwd.records, NODE_SIZE),
            "cross": sum(cross_node_bytes(r, rank, NODE_SIZE) for r in records),
            "memory": (held, predict(opt), padding_allowance(opt)),
            "losses": [*losses, loss.item()],
        }
        opt.close()
    return out


def test_mics_bytes_per_axis_match_the_formula_against_zero3_and_hpz():
    measured = run_distributed(_body, world_size=WORLD, timeout_s=300)
    numels = [p.numel() for p in make_model().parameters()]
    shards = lambda n: sum(-(-x // n) for x in numels)  # noqa: E731 (one bucket: the default)
    common = dict(persistence_threshold_numel=THRESHOLD, param_bytes=4, grad_bytes=4)
    want = {
        "ZeRO-3": zeropp_step_bytes(
            numels, WORLD, NODE_SIZE, bucket_columns=[shards(WORLD)], **common
        ),
        "hpZ": zeropp_step_bytes(
            numels, WORLD, NODE_SIZE, bucket_columns=[shards(WORLD)], hpz=True, **common
        ),
        "MiCS": mics_step_bytes(
            numels, NODE_SIZE, WORLD // NODE_SIZE, bucket_columns=[shards(NODE_SIZE)], **common
        ),
    }
    # The two-level gather (S = 4 = both nodes, R = 1): forward's gathers as one intra-node
    # all-gather (k·Σs·p) and one across nodes (N·Σs·p) per fetch, the same values as ZeRO-3.
    s4 = [-(-n // WORLD) for n in numels if n > THRESHOLD]
    hierarchical = {
        ("all_gather", "intra"): sum(NODE_SIZE * s * 4 for s in s4),
        ("all_gather", "inter"): sum(WORLD * s * 4 for s in s4),
    }
    for rank, result in enumerate(measured):
        assert result["MiCS S=4, hierarchical"]["forward"] == hierarchical, (rank, result)
        assert result["MiCS S=4, hierarchical"]["losses"] == result["ZeRO-3"]["losses"]
        for kind, w in want.items():
            assert result[kind]["forward"] == w.forward, (rank, kind, result[kind], w)
            assert result[kind]["backward"] == w.backward, (rank, kind, result[kind], w)
    # Nothing of MiCS's gathers or reduce-scatters crosses the node boundary, only the all-reduce.
    mics = want["MiCS"].total()
    assert set(mics) == {
        ("all_gather", "intra"),
        ("reduce_scatter", "intra"),
        ("all_reduce", "inter"),
    }
    crossing = {kind: sum(r[kind]["cross"] for r in measured) for kind in want}
    assert crossing["MiCS"] < crossing["hpZ"] < crossing["ZeRO-3"], crossing
    # A replica group of 2 spans both nodes: each rank's all-reduce ring sends 2(R-1)/R·c·g, all
    # of it across (ring of 2: the successor is always on the other node).
    assert crossing["MiCS"] == WORLD * mics[("all_reduce", "inter")], crossing
    # Memory: Ψ/S of the model states per rank, the formula's figure (within padding), about
    # twice plain ZeRO-3's Ψ/N here (persistent parameters are whole in both).
    for result in measured:
        got, want, slack = result["MiCS"]["memory"]
        for column in ("params", "grads", "optimizer"):
            assert abs(getattr(got, column) - getattr(want, column)) <= getattr(slack, column)
        assert want.world_size == NODE_SIZE
        assert got.optimizer > 1.9 * result["ZeRO-3"]["memory"][0].optimizer
