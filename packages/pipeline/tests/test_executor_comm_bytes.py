"""Every point-to-point message goes through the comms logger, and the bytes a stage sends per
step equal `costs.p2p_bytes_sent_per_step` (activations forward, gradients back, one header each)."""

import pytest
import torch
from pipeline_testlib import SEQ, VOCAB, WIDTH, data, lm_loss, tiny_gpt

import minispeed.comm as comm
import minispeed.pipeline as pp
from minispeed.core.testing import run_distributed

BATCH, M = 8, 4


def _bytes_per_step(rank, world_size, schedule, virtual_stages):
    module = pp.partition(tiny_gpt(4), stages=world_size, loss_fn=lm_loss, method="type:Block",
                          virtual_stages=virtual_stages)  # fmt: skip
    ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.01), micro_batches=M,
                             schedule=schedule)  # fmt: skip
    batches = data(3, BATCH)
    ex.train_batch(*batches[0])  # negotiates the layouts
    with comm.CommsLogger() as log:
        for x, y in batches[1:]:
            log.mark_step()
            ex.train_batch(x, y)
    sends = [r for r in log.records if r.op == "send"]
    return {
        "stage": module.stage,
        "wire_per_step": [sum(r.wire_bytes for r in sends if r.step == s) for s in (1, 2)],
        "sends_per_step": [sum(1 for r in sends if r.step == s) for s in (1, 2)],
        "recvs_per_step": [log.count("recv", step=s) for s in (1, 2)],
    }


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_p2p_bytes_per_step_match_the_formula(schedule, v):
    p = 2
    act = (BATCH // M) * SEQ * WIDTH * 4  # (b, T, C) fp32 hidden states, and their gradient
    for res in run_distributed(_bytes_per_step, world_size=p, args=(schedule, v)):
        s = res["stage"]
        want = pp.p2p_bytes_sent_per_step(s, p, M, act, act, virtual_stages=v)
        assert res["wire_per_step"] == [want, want]
        # one header and one tensor per message; both directions' messages per chunk boundary
        messages = sum(M * ((c * p + s < p * v - 1) + (c * p + s > 0)) for c in range(v))
        assert res["sends_per_step"] == [2 * messages] * 2
        assert res["recvs_per_step"] == [2 * messages] * 2


def _dp_and_tied_bytes(rank, world_size):
    module = pp.partition(tiny_gpt(4), stages=2, loss_fn=lm_loss, method="type:Block")
    ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.01), micro_batches=2)
    x, y = data(2, BATCH)[0]
    d = module.grid.rank_in("data")
    half = slice(d * BATCH // 2, (d + 1) * BATCH // 2)
    ex.train_batch(x[half], y[half])
    with comm.CommsLogger() as log:
        log.mark_step()
        ex.train_batch(x[half], y[half])
    return {
        "stage": module.stage,
        "stage_numel": sum(p.numel() for p in module.parameters()),
        "all_reduces": sorted(
            (r.msg_bytes, r.group_size, r.wire_bytes) for r in log.filter("all_reduce", step=1)
        ),
        "sent": sum(r.wire_bytes for r in log.filter("send", step=1)),
        "broadcasts": log.count("broadcast", step=1),
    }


def test_pp_x_dp_reduces_each_stage_once_and_ties_once():
    act = (BATCH // 2 // 2) * SEQ * WIDTH * 4  # per-replica batch 4, M = 2 micro-batches of 2
    tied = VOCAB * WIDTH * 4  # the embedding, on both stages
    for res in run_distributed(_dp_and_tied_bytes, world_size=4):
        # 2 ranks per group: an all-reduce of S bytes sends 2(n−1)/n · S = S
        status = 4 * (1 + 2 * 2)  # [loss, one status code per rank of the 2 × 2 grid], fp32
        want = sorted([
            (tied, 2, tied),  # tied embedding gradient summed over stages 0 and 1
            (4 * res["stage_numel"], 2, 4 * res["stage_numel"]),  # data-parallel gradient average
            # the agreement before the step (over pipe, then data) and the one after it
            *[(status, 2, status)] * 4,
        ])  # fmt: skip
        assert res["all_reduces"] == want
        assert res["broadcasts"] == 0  # the loss rides the agreement: no broadcast any more
        assert res["sent"] == pp.p2p_bytes_sent_per_step(res["stage"], 2, 2, act, act)
