"""ZeRO-Infinity: a swap-file read or write that fails on ONE rank is a clear error on EVERY rank,
never a wait in the others' next collective (Note [an I/O failure fails every rank] in
stage3/io_failures.py).

Each case breaks one of rank 1's files under the running job, at one phase:

- forward fetch: a parameter shard file deleted (the fetch reads zeros, the step's agreement
  flags raise on every rank before any update);
- backward: a gradient file deleted between the two micro-steps of an accumulation window (the
  read-add-write fails inside a backward hook);
- step: an optimizer partition file deleted (the read/step/write pipeline fails; the end-of-step
  agreement raises on every rank).

Every rank must raise `zero.OffloadIOError` naming rank 1 and the file. Before this mechanism,
rank 1 raised alone and rank 0 waited in its next collective (forward, backward) or stepped on
(step): each case then ends in a hang (the short harness timeout) or in rank 0 returning no error.
`close()` afterwards is collective too: it works, or (a shard file still missing) raises on every
rank. And a full disk on rank 1 while `zero.Init(config)` writes the shards is an error on both
ranks when `Init` ends. Needs the `[offload]` extra; skipped without it.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch
from stage3_testlib import GLOBAL_BATCH, LR, infinity_config
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3.params import REGISTRY

AsyncIO = pytest.importorskip("minispeed.offload.aio").AsyncIO

TIMEOUT_S = 90  # a hang fails fast: the bodies take a few seconds


def _victim(opt: zero.ZeroOptimizer, model: torch.nn.Module, phase: str) -> str:
    if phase == "forward":  # the token embedding's shard file: read by every forward
        sp = REGISTRY[model.wte.weight]
        return str(opt.strategy.param_home.files[id(sp)].path)
    if phase == "backward":  # a gradient written by this window's first micro-step
        grads = opt.optimizer.grads
        return str(next(st.path for key, st in grads.files.items() if key in grads.written))
    return str(opt.optimizer.partitions[0].swap.path)  # an optimizer partition: the step


def _break_one_rank(rank: int, world_size: int, nvme_path: str, phase: str) -> dict:
    accum = 2 if phase == "backward" else 1
    model = make_model()
    opt = zero.shard(
        model,
        torch.optim.AdamW(model.parameters(), lr=LR),
        config=infinity_config(nvme_path, accum),
    )
    first, second = (rank_slice(b, rank, world_size) for b in make_batches(2, GLOBAL_BATCH))
    for _ in range(accum):  # one healthy step: every file exists and holds data
        opt.backward(model(*first))
        opt.step()
    error, victim, stepped = "", "", opt.global_step
    try:
        for micro in range(accum):
            if micro == accum - 1 and rank == 1:  # break rank 1's file just before its use
                victim = _victim(opt, model, phase)
                os.remove(victim)
            opt.backward(model(*second))
            opt.step()
    except OSError as exc:  # zero.OffloadIOError is one; checked by name below
        error = f"{type(exc).__name__}: {exc}"
    close_error = ""
    try:
        opt.close()
    except OSError as exc:
        close_error = f"{type(exc).__name__}: {exc}"
    return dict(
        error=error, victim=victim, stepped=opt.global_step - stepped, close_error=close_error
    )


@pytest.mark.parametrize("phase", ["forward", "backward", "step"])
def test_infinity_io_failure_on_one_rank_raises_on_every_rank(tmp_path, phase: str) -> None:
    results = run_distributed(
        _break_one_rank, world_size=2, args=(str(tmp_path), phase), timeout_s=TIMEOUT_S
    )
    victim = results[1]["victim"]
    for rank, res in enumerate(results):
        assert res["error"].startswith("OffloadIOError: "), f"rank {rank}: {res['error']!r}"
        assert "failed on rank 1 of 2" in res["error"], res["error"]
        assert victim in res["error"], res["error"]
        assert "resume from the last checkpoint" in res["error"], res["error"]
        assert res["stepped"] == 0, f"rank {rank} counted a step"
    assert results[0]["error"] == results[1]["error"]
    if phase == "forward":  # close() gathers the model back: the shard is still missing
        for res in results:
            assert res["close_error"].startswith("OffloadIOError: "), res["close_error"]
            assert victim in res["close_error"], res["close_error"]
    else:
        assert [res["close_error"] for res in results] == ["", ""]
    if phase != "step":  # failed between collectives: found by the step's agreement flags
        assert "before any update" in results[0]["error"], results[0]["error"]


def _full_disk_in_init(rank: int, world_size: int, nvme_path: str) -> dict:
    real = AsyncIO.submit_write
    victims: list[str] = []

    def full_disk(self, tensor, path, offset=0, **kwargs):  # rank 1's disk fills at shard 3
        if rank == 1 and os.path.basename(path) == "param-3.swp":
            victims.append(str(path))
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
        return real(self, tensor, path, offset, **kwargs)

    AsyncIO.submit_write = full_disk  # this worker process only; restored below
    error = ""
    try:
        with zero.Init(config=infinity_config(nvme_path)):
            make_model()
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        AsyncIO.submit_write = real
    return dict(error=error, victim=victims[0] if victims else "")


def test_infinity_init_write_failure_on_one_rank_raises_on_every_rank(tmp_path) -> None:
    """`zero.Init(config)` writes each shard as it is built, between the broadcasts that
    partition the parameters: a full disk on rank 1 is an error on both ranks when Init ends
    (before, rank 1 left Init alone and rank 0 waited in its next broadcast)."""
    results = run_distributed(
        _full_disk_in_init, world_size=2, args=(str(tmp_path),), timeout_s=TIMEOUT_S
    )
    victim = results[1]["victim"]
    assert victim
    for rank, res in enumerate(results):
        assert res["error"].startswith("OffloadIOError: "), f"rank {rank}: {res['error']!r}"
        assert "failed on rank 1 of 2" in res["error"] and victim in res["error"], res["error"]
        assert "end of zero.Init" in res["error"], res["error"]
