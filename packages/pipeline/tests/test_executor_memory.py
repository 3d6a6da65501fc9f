"""Activation memory by schedule, counted by the executor: 1F1B keeps at most P − s micro-batches
in flight on stage s whatever M is, GPipe keeps all M, ZB-H1 keeps P on every stage (the
executor's count, and the tensors autograd actually keeps, counted by saved-tensor hooks). And the
timeline the executor records:
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


class _Held:
    """One activation saved for backward, alive until autograd frees it."""

    live = peak = 0

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        _Held.live += 1
        _Held.peak = max(_Held.peak, _Held.live)

    def __del__(self) -> None:
        _Held.live -= 1


def _live_saved(rank, world_size):
    """Peak number of tensors autograd keeps for backward (parameters excluded), per schedule
    and M: the activation memory itself, counted by saved-tensor hooks, not by the executor."""
    out = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            module = pp.partition(
                tiny_gpt(2), stages=world_size, loss_fn=lm_loss, method="type:Block"
            )
            weights = {q.untyped_storage().data_ptr() for q in module.parameters()}
            ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.01),
                                     micro_batches=m, schedule=schedule)  # fmt: skip

            def pack(t, weights=weights):
                return t if t.untyped_storage().data_ptr() in weights else _Held(t)

            def unpack(h):
                return h.t if isinstance(h, _Held) else h

            _Held.live = _Held.peak = 0
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                ex.train_batch(*data(1, 2 * m)[0])
            out[schedule, m] = (_Held.peak, _Held.live)
    return out


def test_live_activations_1f1b_hold_p_minus_s_micro_batches_gpipe_holds_m():
    p = 2
    for s, res in enumerate(run_distributed(_live_saved, world_size=p)):
        assert all(live == 0 for _, live in res.values())  # all freed by the end of the batch
        per_micro_batch = res["gpipe", 4][0] // 4
        assert per_micro_batch > 0
        for m in (4, 8):
            assert res["gpipe", m][0] == m * per_micro_batch  # grows with M
            assert res["1f1b", m][0] == (p - s) * per_micro_batch  # bounded by P − s
