"""An exception on one rank while saving or loading reaches every rank as an error, within the
call: no rank is left waiting in a collective (Note [a checkpoint fails on every rank])."""

from __future__ import annotations

import torch
from ckpt_testlib import build, train
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.comm as comm
import minispeed.zero as zero
import minispeed.zero.checkpoints.pending as save_module  # where the files are written
from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import CheckpointError, load_checkpoint, save_checkpoint


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device (injected on rank 1)")


def _save_fails_body(rank: int, world_size: int, path: str):
    model, opt = build(stage=2)
    train(model, opt, rank, world_size, range(0, 1))
    save_checkpoint(opt, model, path, tag="good")
    train(model, opt, rank, world_size, range(1, 2))
    real_save = save_module.atomic_save
    if rank == 1:
        save_module.atomic_save = _disk_full  # this rank's shard write fails
    try:
        save_checkpoint(opt, model, path, tag="bad")
        message = None
    except CheckpointError as e:
        message = str(e)
    finally:
        save_module.atomic_save = real_save  # the worker process serves later tests too
    # Every rank is still in step: training goes on together.
    losses = train(model, opt, rank, world_size, range(2, 3))
    return message, losses


def _load_fails_body(rank: int, world_size: int, path: str):
    model, opt = build(stage=2)
    train(model, opt, rank, world_size, range(0, 1))
    save_checkpoint(opt, model, path)
    model2, opt2 = build(stage=2, seed=3)
    real_load = torch.load
    if rank == 1:

        def failing_load(f, *args, **kwargs):
            if "weights." in str(f):
                raise OSError(5, "Input/output error (injected on rank 1)")
            return real_load(f, *args, **kwargs)

        torch.load = failing_load  # this rank's shard read fails
    try:
        load_checkpoint(opt2, model2, path)
        message = None
    except CheckpointError as e:
        message = str(e)
    finally:
        torch.load = real_load  # the worker process serves later tests too
    probe = torch.ones(1)
    comm.all_reduce(probe)  # every rank left load_checkpoint: nobody waits in it
    return message, probe.item()


def test_a_failed_write_on_one_rank_raises_on_every_rank(tmp_path):
    results = run_distributed(_save_fails_body, world_size=2, args=(str(tmp_path),), timeout_s=120)
    for message, losses in results:
        assert message is not None
        assert "failed on rank 1 of 2" in message and "No space left on device" in message
        assert "'bad'" in message
        assert len(losses) == 1
    assert (tmp_path / "latest").read_text().strip() == "good"
    assert not (tmp_path / "bad" / "metadata.json").exists()  # never sealed


def test_a_failed_read_on_one_rank_raises_on_every_rank(tmp_path):
    results = run_distributed(_load_fails_body, world_size=2, args=(str(tmp_path),), timeout_s=120)
    for message, probe in results:
        assert message is not None
        assert "failed on rank 1 of 2" in message and "Input/output error" in message
        assert probe == 2.0


def test_a_bad_moment_is_refused_on_every_rank(tmp_path):
    """A save inside an accumulation window is refused everywhere (it was already per rank)."""
    results = run_distributed(_mid_window_body, world_size=2, args=(str(tmp_path),), timeout_s=120)
    for message in results:
        assert "inside a gradient accumulation window" in message


def _mid_window_body(rank: int, world_size: int, path: str) -> str:
    model = make_model(0)
    opt = zero.shard(
        model,
        torch.optim.AdamW(model.parameters()),
        zero.ZeroConfig(stage=2, gradient_accumulation_steps=2),
    )
    idx, tgt = rank_slice(make_batches(1, 4)[0], rank, world_size)
    opt.backward(model(idx, tgt))
    opt.step()
    try:
        save_checkpoint(opt, model, path)
    except CheckpointError as e:
        return str(e)
    return ""
