"""A check that fails on ONE rank before any message (no optimizer in `train_batch`, a layer
whose constructor raises, a stage count the world does not divide, `partition` or an executor
built with other arguments) raises on every rank of a
2-stage × 2-replica grid within seconds: the failed rank its own error, the others a named
error. Before, the failed rank raised alone and its peers waited in a receive (or the first
collective) forever.

Grid layout (`pipeline.partition` on 4 ranks, stages=2): global rank = 2 · stage + replica."""

import time

import torch
from pipeline_testlib import Block, data, lm_loss, tiny_gpt

import minispeed.pipeline as pp
from minispeed.core.testing import run_distributed
from minispeed.pipeline import LayerSpec

BATCH, M = 8, 2
BOUND_S = 20.0  # generous for a loaded machine; the old code waited until the harness timeout


class BadOnStage1(Block):
    """A layer whose constructor fails on the rank that builds it (stage 1 only)."""

    def __init__(self, width: int) -> None:
        raise RuntimeError("injected constructor failure")


def _attempt(fn):
    start = time.monotonic()
    try:
        fn()
        return None
    except Exception as exc:
        return {"error": type(exc).__name__, "text": str(exc), "s": time.monotonic() - start}


def _executor(module, optimizer=None, **kwargs):
    opt = optimizer or torch.optim.SGD(module.parameters(), lr=0.1)
    return pp.PipelineExecutor(module, opt, **{"micro_batches": M, **kwargs})


def _failures_before_start(rank, world_size):
    out = {}
    d = rank % 2
    x, y = data(1, BATCH)[0]
    half = slice(d * BATCH // 2, (d + 1) * BATCH // 2)

    # train_batch on a rank whose executor has no optimizer: stage 0 (rank 1), then stage 1
    for bad in (1, 2):
        module = pp.partition(tiny_gpt(2), stages=2, loss_fn=lm_loss, method="type:Block$")
        opt = None if rank == bad else torch.optim.SGD(module.parameters(), lr=0.1)
        ex = pp.PipelineExecutor(module, opt, micro_batches=M)
        out[f"no_optimizer_{bad}"] = _attempt(lambda ex=ex: ex.train_batch(x[half], y[half]))

    # a layer constructor that raises on the ranks of stage 1 only
    layers = tiny_gpt(2)
    layers[2] = LayerSpec(BadOnStage1, (8,))
    out["build"] = _attempt(
        lambda: pp.partition(layers, stages=2, loss_fn=lm_loss, method=[0, 2, 4])
    )

    # partition's own arguments on one rank: a stage count the world does not divide, another one
    out["stages_3"] = _attempt(
        lambda: pp.partition(tiny_gpt(2), stages=3 if rank == 3 else 2, loss_fn=lm_loss)
    )
    out["stages_4"] = _attempt(
        lambda: pp.partition(tiny_gpt(2), stages=4 if rank == 3 else 2, loss_fn=lm_loss)
    )

    # executor arguments that differ on one rank: a bad schedule, another micro-batch count
    module = pp.partition(tiny_gpt(2), stages=2, loss_fn=lm_loss, method="type:Block$")
    out["bad_schedule"] = _attempt(
        lambda: _executor(module, schedule="pipedream" if rank == 3 else "1f1b")
    )
    out["micro_batches"] = _attempt(lambda: _executor(module, micro_batches=4 if rank == 0 else 2))
    return out


def _named(rank: int) -> str:
    stage, replica = divmod(rank, 2)
    return f"pipeline stage {stage} of data-parallel replica {replica} (global rank {rank})"


def test_a_check_failing_on_one_rank_before_any_message_raises_on_every_rank():
    results = run_distributed(_failures_before_start, world_size=4, timeout_s=120)
    for rank, res in enumerate(results):
        for bad in (1, 2):
            got = res[f"no_optimizer_{bad}"]
            assert got is not None and got["s"] < BOUND_S, (bad, rank, got)
            if rank == bad:
                assert got["error"] == "ValueError" and "needs an optimizer" in got["text"]
            else:
                assert got["error"] == "PipelineAbortedError", (bad, rank, got)
                assert f"{_named(bad)} failed in start" in got["text"], got["text"]

        got = res["build"]
        assert got is not None and got["s"] < BOUND_S, (rank, got)
        if rank >= 2:  # stage 1 built the bad layer
            assert got["error"] == "RuntimeError" and "injected" in got["text"]
        else:
            assert got["error"] == "PipelineAbortedError", (rank, got)
            assert f"{_named(2)}; {_named(3)} failed while building" in got["text"], got["text"]

        got = res["stages_3"]
        assert got is not None and got["s"] < BOUND_S, (rank, got)
        if rank == 3:
            assert got["error"] == "ValueError" and "not divisible by stages=3" in got["text"]
        else:
            assert got["error"] == "PipelineAbortedError", (rank, got)
            assert "global rank 3 failed while checking pipeline.partition" in got["text"]
        got = res["stages_4"]
        assert got["error"] == "ValueError", (rank, got)
        assert "disagree on stages" in got["text"] and "global rank 3: 4" in got["text"]

        got = res["bad_schedule"]
        if rank == 3:
            assert got["error"] == "ScheduleConfigError" and "pipedream" in got["text"]
        else:
            assert got["error"] == "PipelineAbortedError" and _named(3) in got["text"], got

        got = res["micro_batches"]
        assert got["error"] == "ValueError", (rank, got)
        assert "disagree on micro_batches" in got["text"] and f"{_named(0)}: 4" in got["text"]
