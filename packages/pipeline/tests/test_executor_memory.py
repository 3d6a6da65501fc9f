"""Activation memory by schedule, counted by the executor: 1F1B keeps at most P − s micro-batches
in flight on stage s whatever M is, GPipe keeps all M, ZB-H1 keeps P on every stage. And the timeline the executor records:
one compute interval per pass, one wait per receive, in program order."""

import torch
from pipeline_testlib import data, lm_loss, tiny_gpt

import minispeed.pipeline as pp
from minispeed.core.testing import run_distributed


def _peaks(rank, world_size, micro_batches):
    out = {}
    for schedule in ("gpipe", "1f1b", "zb_h1"):
        module = pp.partition(tiny_gpt(2), stages=world_size, loss_fn=lm_loss, method="type:Block")
        ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.01),
                                 micro_batches=micro_batches, schedule=schedule)  # fmt: skip
        ex.train_batch(*data(1, 2 * micro_batches)[0])
        out[schedule] = ex.peak_in_flight
        program = ex.schedule.program(module.stage)
        out[f"{schedule}/expected"] = [
            ("compute" if isinstance(i, (pp.Forward, pp.Backward, pp.BackwardInput, pp.BackwardWeight))
             else "wait", i.label)
            for i in program if isinstance(i, (pp.Forward, pp.Backward, pp.BackwardInput,
                                               pp.BackwardWeight, pp.RecvActivation, pp.RecvGrad))
        ]  # fmt: skip
        out[f"{schedule}/timeline"] = ex.timeline.as_rows()
        out[f"{schedule}/busy_wait"] = (
            ex.timeline.busy_s(),
            ex.timeline.wait_s(),
            ex.timeline.span_s(),
        )
    return out


def test_1f1b_in_flight_stays_bounded_while_gpipe_grows_with_m():
    p = 2
    for m in (4, 8):
        for s, peaks in enumerate(run_distributed(_peaks, world_size=p, args=(m,))):
            assert peaks["gpipe"] == m == pp.in_flight_bound("gpipe", s, p, m)
            assert peaks["1f1b"] == p - s == pp.in_flight_bound("1f1b", s, p, m)
            assert peaks["zb_h1"] == p == pp.in_flight_bound("zb_h1", s, p, m)


def test_the_timeline_records_each_pass_and_each_wait_in_order():
    for res in run_distributed(_peaks, world_size=2, args=(4,)):
        for schedule in ("gpipe", "1f1b", "zb_h1"):
            rows = res[f"{schedule}/timeline"]
            assert [(kind, label) for kind, label, _, _ in rows] == res[f"{schedule}/expected"]
            ends = [0.0] + [end for _, _, _, end in rows]
            assert all(start >= prev for (_, _, start, _), prev in zip(rows, ends))  # no overlap
            busy, wait, span = res[f"{schedule}/busy_wait"]
            assert 0 < busy <= span and busy + wait <= span + 1e-6
