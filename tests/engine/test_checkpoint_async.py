"""`checkpoint.async_save`: training goes on while the files are written, what lands is the
snapshot taken at the call, a failed background write raises on every rank at the next wait,
and a process killed with SIGKILL at random moments of its saves never loses `latest`."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import async_save_job
import pytest
import torch
from ds_gpt import GPT, batch

import minispeed.engine as deepspeed
from minispeed.core.testing import run_distributed
from minispeed.engine.checkpoint.background import checkpointer_of
from minispeed.zero.checkpoints.layout import load_shard, read_metadata


def _engine(async_save: bool):
    torch.manual_seed(0)
    model = GPT()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={
            "train_batch_size": 4,
            "zero_optimization": {"stage": 3},
            "checkpoint": {"async_save": async_save},
        },
    )
    return engine


def _evaluate(engine) -> float:
    engine.eval()
    with torch.no_grad():
        x, y = batch(99, 0, 0, 1)
        loss = engine(x, y).item()
    engine.train()
    return loss


def _train(engine, steps, rank, world_size):
    for step in steps:
        x, y = batch(step, 0, rank, world_size)
        engine.backward(engine(x, y))
        engine.step()


def _save_async_and_train_on(rank, world_size, path):
    engine = _engine(async_save=True)
    _train(engine, range(2), rank, world_size)
    at_save = _evaluate(engine)
    engine.save_checkpoint(path, client_state={"k": 1})  # returns after the host copy
    _train(engine, range(2, 4), rank, world_size)  # changes every weight while files land
    after = _evaluate(engine)
    engine.save_checkpoint(path)  # waits for the first, then snapshots step 4
    checkpointer_of(engine).wait()  # (a test worker lives on: no exit to wait at)
    _, client = _engine(async_save=True).load_checkpoint(path, tag="global_step2")
    return at_save, after, client


def _load(rank, world_size, path, tag):
    engine = _engine(async_save=False)
    engine.load_checkpoint(path, tag=tag)
    return _evaluate(engine), engine.global_steps


def test_async_save_writes_the_snapshot_taken_at_the_call(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    results = run_distributed(_save_async_and_train_on, world_size=2, args=(path,), timeout_s=180)
    at_save, after, client = results[0]
    assert at_save != pytest.approx(after, abs=1e-4) and client == {"k": 1}
    # `latest` moved to the second save once it landed
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step4\n"
    for tag, want, steps in (("global_step2", at_save, 2), ("global_step4", after, 4)):
        (loaded,) = run_distributed(_load, world_size=1, args=(path, tag), timeout_s=120)
        assert loaded[0] == pytest.approx(want, abs=1e-5) and loaded[1] == steps


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device (injected on rank 1)")


def _background_failure(rank, world_size, path):
    import minispeed.zero.checkpoints.pending as pending

    engine = _engine(async_save=True)
    _train(engine, range(1), rank, world_size)
    engine.save_checkpoint(path)
    checkpointer_of(engine).wait()  # the first save lands before the disk "fills"
    real = pending.atomic_save
    if rank == 1:
        pending.atomic_save = _disk_full
    try:
        engine.save_checkpoint(path, tag="bad")
        with pytest.raises(Exception) as e:
            engine.load_checkpoint(path)  # waits for the save in flight, which failed on rank 1
    finally:
        pending.atomic_save = real
    where, _ = engine.load_checkpoint(path)
    return str(e.value), where


def test_a_failed_background_write_raises_on_every_rank(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    results = run_distributed(_background_failure, world_size=2, args=(path,), timeout_s=180)
    for message, where in results:
        assert "rank 1" in message and "No space left" in message, message
        # `latest` never moved to the failed tag
        assert os.path.basename(os.path.dirname(where)) == "global_step1"


def _step_of(tag: str) -> int:
    return int(tag.removeprefix("global_step"))


def _check_loadable(root: Path, tag: str) -> None:
    """Sealed, every file at its recorded size and readable, weights equal to the snapshot's."""
    tag_dir = root / "ckpt" / tag
    meta = read_metadata(tag_dir)
    expect = torch.load(root / "expect" / f"{tag}.pt", weights_only=True)
    saved = {name: torch.full((expect[name].numel(),), float("nan")) for name in expect}
    for shard in meta.shards:
        load_shard(tag_dir / shard.optim_file, tag, weights_only=True)
        packed = load_shard(tag_dir / shard.weights_file, tag, weights_only=True)
        offset = 0
        for name, start, numel in packed["index"]:
            saved[name][start : start + numel] = packed["values"][offset : offset + numel]
            offset += numel
    for name, values in saved.items():  # every element present (no NaN left) and equal
        torch.testing.assert_close(values, expect[name].reshape(-1), rtol=0, atol=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("world_size", "trials"), [(1, 20), (2, 10)])
def test_kill_9_at_random_moments_never_loses_latest(tmp_path, world_size, trials) -> None:
    ctx = mp.get_context("forkserver")
    # torch._dynamo: imported by the first optimizer built (6 s here); each fork inherits it
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "minispeed.engine", "async_save_job"])
    rng = random.Random(2026 + world_size)
    mid_save = 0
    for trial in range(trials):
        out = tmp_path / f"trial{trial}"
        port = _free_port()
        jobs = [
            ctx.Process(target=async_save_job.run, args=(str(out), 10_000, r, world_size, port))
            for r in range(world_size)
        ]
        for job in jobs:
            job.start()
        deadline = time.monotonic() + 60
        while not (out / "ready").exists():
            alive = all(job.is_alive() for job in jobs)
            assert alive and time.monotonic() < deadline, f"trial {trial} never ready"
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.4))
        # The ranks die one after the other in a random order (one node first, then the job is
        # torn down): a leader that sealed without a dead rank's files would be caught here.
        for i, job in enumerate(rng.sample(jobs, len(jobs))):
            if i:
                time.sleep(rng.uniform(0.0, 0.3))
            if job.is_alive():  # (a survivor may fail on its own: its peer reset the link)
                job.kill()
        for job in jobs:
            job.join()
        assert jobs[0].exitcode == -signal.SIGKILL or world_size > 1
        latest = (out / "ckpt" / "latest").read_text().strip()
        _check_loadable(out, latest)
        newer = [
            d.name
            for d in (out / "ckpt").iterdir()
            if d.is_dir() and _step_of(d.name) > _step_of(latest)
        ]
        mid_save += bool(newer)  # a save was under way when the kill came
    assert mid_save >= trials // 2, f"only {mid_save} of {trials} kills hit a save in flight"


def test_exit_waits_for_the_save_in_flight(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    job = subprocess.run(
        [sys.executable, async_save_job.__file__, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step1\n"
    read_metadata(tmp_path / "ckpt" / "global_step1")  # sealed, every file at its size


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ({"async_sav": True}, "async_save"),  # did-you-mean
        ({"async_save": "yes"}, "must be true or false"),
        ({"async_save": True, "use_node_local_storage": True}, "turn one of them off"),
        ({"tag_validation": "Strict"}, "must be one of WARN, FAIL, IGNORE"),  # DeepSpeed's modes
    ],
)
def test_checkpoint_section_errors_name_the_key(section, words) -> None:
    from minispeed.engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError) as e:
        EngineConfig.from_ds_config({"train_batch_size": 1, "checkpoint": section})
    assert words in str(e.value) and "checkpoint" in str(e.value), str(e.value)
    ok = EngineConfig.from_ds_config({"train_batch_size": 1, "checkpoint": {"async_save": True}})
    assert ok.checkpoint.async_save and not ok.checkpoint.use_node_local_storage
