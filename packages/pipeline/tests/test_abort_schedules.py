"""The abort protocol under every schedule on 2 ranks, where each rank is both neighbours of the
other (interleaved: messages go both ways between the same two ranks): a failure in the first or
the last forward, backward (ZB-H1: its input pass `b`), ZB-H1's weight pass `W`, on either rank,
in either chunk, during training or eval, stops both ranks at once with named errors and leaves
the parameters untouched."""

import time

import torch
from pipeline_testlib import data, lm_loss, tiny_gpt

import minispeed.pipeline as pp
from minispeed.core.testing import run_distributed

BATCH, M = 8, 4
BOUND_S = 20.0  # generous for a loaded machine; a hang would last the group timeout (minutes)
SCHEDULES = {"gpipe": 1, "1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2}


class Injected(RuntimeError):
    """The failure a test injects."""


def _arm(block: torch.nn.Module, where: str, call: int) -> None:
    calls = [0]

    def fire(*_):
        calls[0] += 1
        if calls[0] == call:
            raise Injected(f"injected {where} failure at call {call}")

    if where in ("forward", "eval"):
        block.register_forward_pre_hook(fire)
    elif where == "backward":  # the gradient of the block's output: B, or ZB-H1's b
        block.register_forward_hook(lambda m, i, out: out.register_hook(fire) and None)
    else:  # "weight": a parameter's gradient, computed by ZB-H1's W
        block.up.weight.register_hook(fire)


def _one(rank, schedule, where, bad_rank, chunk, call):
    module = pp.partition(tiny_gpt(4), stages=2, loss_fn=lm_loss, method="type:Block$",
                          virtual_stages=SCHEDULES[schedule])  # fmt: skip
    ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1),
                             micro_batches=M, schedule=schedule)  # fmt: skip
    batches = data(2, BATCH)
    ex.train_batch(*batches[0])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    if rank == bad_rank:
        _arm(next(iter(module.chunks[chunk].layers.values())), where, call)
    start = time.monotonic()
    try:
        (ex.eval_batch if where == "eval" else ex.train_batch)(*batches[1])
        return None
    except Exception as exc:
        elapsed = time.monotonic() - start
        unchanged = all(torch.equal(before[k], v) for k, v in module.state_dict().items())
        return type(exc).__name__, str(exc), elapsed, unchanged


def _cases():
    out = []
    for schedule, v in SCHEDULES.items():
        wheres = ["forward", "backward"] + (["weight"] if schedule == "zb_h1" else [])
        for where in wheres:
            for bad_rank in (0, 1):
                for chunk in range(v):
                    # the first and the last of this chunk's M passes (the last only for the
                    # schedules other tests already cover)
                    calls = (1, M) if schedule in ("zb_h1", "interleaved_1f1b") else (M,)
                    for call in calls:
                        out.append((schedule, where, bad_rank, chunk, call))
    out += [("1f1b", "eval", 1, 0, 2), ("interleaved_1f1b", "eval", 0, 1, 3)]
    return out


def _all_cases(rank, world_size):
    return [_one(rank, *case) for case in _cases()]


def test_a_failure_anywhere_in_any_schedule_stops_both_ranks():
    results = run_distributed(_all_cases, world_size=2, timeout_s=90)
    phase = {"forward": "forward", "eval": "forward", "backward": "backward", "weight": "backward"}
    for i, (schedule, where, bad_rank, chunk, call) in enumerate(_cases()):
        label = f"{schedule} {where} on rank {bad_rank} chunk {chunk} call {call}"
        for rank in (0, 1):
            res = results[rank][i]
            assert res is not None, f"{label}: rank {rank} finished the batch"
            name, text, elapsed, unchanged = res
            assert elapsed < BOUND_S and unchanged, (label, rank, elapsed)
            if rank == bad_rank:
                assert name == "Injected", (label, text)
            else:
                assert name == "PipelineAbortedError", (label, rank, name, text)
                assert (
                    f"pipeline stage {bad_rank} of data-parallel replica 0 (global rank "
                    f"{bad_rank}) failed in {phase[where]}"
                ) in text, (label, text)
