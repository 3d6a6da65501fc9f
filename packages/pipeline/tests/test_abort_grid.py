"""A failure on ONE rank of a 2-stage × 2-replica grid reaches all four ranks within seconds:
at forward, at backward, in the data-parallel reduction (before and after its all-reduce), in the
optimizer step, a bad micro-batch on one replica, a NaN loss. The failed rank raises its own
error, the others `PipelineAbortedError` naming it; no rank steps; never a hang.

Grid layout (`pipeline.partition` on 4 ranks, stages=2): global rank = 2 · stage + replica."""

import time

import torch
from pipeline_testlib import VOCAB, data, lm_loss, tiny_gpt

import minispeed.pipeline as pp
from minispeed.core.testing import run_distributed

BATCH, M = 8, 2
BOUND_S = 20.0  # generous for a loaded machine; a hang would last the group timeout (minutes)


class Injected(RuntimeError):
    """The failure a test injects."""


def _raise_on_call(n: int, what: str):
    calls = [0]

    def hook(*_):
        calls[0] += 1
        if calls[0] == n:
            raise Injected(f"injected {what} failure")

    return hook


def _block(module: pp.PipelineModule) -> torch.nn.Module:
    return next(iter(module.chunks[0].layers.values()))


def _inject(where: str, ex: pp.PipelineExecutor) -> None:
    """Arm the failure on this rank; it fires during the next batch."""
    block = _block(ex.module)
    if where == "forward":  # the second micro-batch's forward
        block.register_forward_pre_hook(_raise_on_call(2, "forward"))
    elif where == "backward":  # the gradient of the block's output, in the first backward
        hook = _raise_on_call(1, "backward")
        block.register_forward_hook(lambda m, i, out: out.register_hook(hook) and None)
    elif where == "dp_before":
        ex.reducer.flatten = _raise_on_call(1, "dp")
    elif where == "dp_after":
        ex.reducer.unflatten = _raise_on_call(1, "dp")
    elif where == "step":
        ex.optimizer.step = _raise_on_call(1, "step")
    elif where == "nan":  # this batch's M forwards only
        calls = [0]

        def poison(m, i, out):
            calls[0] += 1
            return out * float("nan") if calls[0] <= M else None

        block.register_forward_hook(poison)


def _one_failure(rank, world_size, where, bad_rank, schedule):
    module = pp.partition(tiny_gpt(2), stages=2, loss_fn=lm_loss, method="type:Block$")
    ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1),
                             micro_batches=M, schedule=schedule)  # fmt: skip
    d = module.grid.rank_in("data")
    half = slice(d * BATCH // 2, (d + 1) * BATCH // 2)
    batches = [(x[half], y[half]) for x, y in data(3, BATCH)]
    ex.train_batch(*batches[0])  # layouts negotiated, call sites warm
    before = {k: v.clone() for k, v in module.state_dict().items()}
    x, y = batches[1]
    if where == "longer_sequence" and d == 1:  # a bad micro-batch on replica 1 only
        x, y = torch.randint(0, VOCAB, (x.shape[0], x.shape[1] + 1)), y.new_zeros(y.shape[0], 5)
    elif rank == bad_rank:
        _inject(where, ex)
    start = time.monotonic()
    try:
        ex.train_batch(x, y)
        return None
    except Exception as exc:
        out = {"error": type(exc).__name__, "text": str(exc), "s": time.monotonic() - start}
    unchanged = all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    out["unchanged"] = unchanged
    out["grads_cleared"] = all(q.grad is None for q in module.parameters())
    try:  # the next batch: refused after a failure inside the programs or the step
        out["next"] = ex.train_batch(*batches[2])
    except Exception as exc:
        out["next"] = type(exc).__name__
    return out


def _all_failures(rank, world_size, cases, schedule="1f1b"):
    return [_one_failure(rank, world_size, where, bad, schedule) for where, bad in cases]


CASES = [("forward", 3), ("backward", 0), ("dp_before", 2), ("dp_after", 1), ("step", 1)]
PHASE = {"forward": "forward", "backward": "backward", "dp_before": "dp", "dp_after": "dp",
         "step": "step"}  # fmt: skip


def _named(rank: int) -> str:
    stage, replica = divmod(rank, 2)
    return f"pipeline stage {stage} of data-parallel replica {replica} (global rank {rank})"


def test_a_failure_on_one_rank_of_a_2x2_grid_reaches_every_rank():
    results = run_distributed(_all_failures, world_size=4, args=(CASES,), timeout_s=90)
    for i, (where, bad) in enumerate(CASES):
        for rank, res in enumerate(r[i] for r in results):
            assert res is not None, f"{where}: rank {rank} finished the batch"
            assert res["s"] < BOUND_S, (where, rank, res["s"])
            if rank == bad:
                assert res["error"] == "Injected", (where, res)
            else:
                assert res["error"] == "PipelineAbortedError", (where, rank, res)
                assert f"{_named(bad)} failed in {PHASE[where]}" in res["text"], res["text"]
            if where == "step":  # the others stepped before they learnt of it
                assert "parameters may now differ" in res["text"] or rank == bad
            else:  # nobody stepped, nothing left in .grad
                assert res["unchanged"] and res["grads_cleared"], (where, rank)
            if where.startswith("dp"):  # every program had finished: nothing left unread, go on
                assert isinstance(res["next"], float), (where, rank, res["next"])
            else:  # messages may be left unread / replicas differ: the executor refuses to go on
                assert res["next"] == "PipelineAbortedError", (where, rank, res["next"])


def test_a_bad_micro_batch_on_one_replica_and_a_nan_loss_reach_every_rank():
    cases = [("longer_sequence", None), ("nan", 1)]
    results = run_distributed(_all_failures, world_size=4, args=(cases,), timeout_s=90)
    for rank, (bad_shape, nan) in enumerate(results):
        assert bad_shape["s"] < BOUND_S and nan["s"] < BOUND_S
        if rank in (1, 3):  # replica 1's two stages: sender and receiver of the bad activation
            assert bad_shape["error"] == "PipelineShapeError"
            assert "shaped (float32[2, 5, 8] grad)" in bad_shape["text"]
        else:
            assert bad_shape["error"] == "PipelineAbortedError"
            assert f"{_named(1)} failed in send" in bad_shape["text"]
            assert f"{_named(3)} failed in recv" in bad_shape["text"]
        assert bad_shape["unchanged"] and bad_shape["next"] == "PipelineAbortedError"
        # a NaN on one replica: every rank raises before the step and can go on with the next
        assert nan["error"] == "NonFiniteLossError" and "loss is nan" in nan["text"]
        assert nan["unchanged"] and nan["grads_cleared"]
        assert isinstance(nan["next"], float) and nan["next"] == nan["next"]
