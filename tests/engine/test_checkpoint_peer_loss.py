"""A rank that dies while an asynchronous save is written does not hold the survivors at exit:
once a collective has failed they give the save up at once, and with no collective left to fail
they wait for its done marker no longer than the process group's timeout; `latest` stays on the
last complete tag (Note [a failed collective breaks the group] in minispeed.comm)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import peer_loss_job

from minispeed.zero.checkpoints.layout import read_metadata

TIMEOUT_S = 5  # the process group's: how long the quiet survivor waits for the marker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_survivor_exits_without_waiting_for_a_dead_ranks_save(tmp_path) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "minispeed.engine", "peer_loss_job"])
    # Both cases at once (4 processes). Before the fix each survivor waited 600 s for the dead
    # rank's done marker (EXIT_WAIT_S), whatever the process group's timeout.
    jobs = {}
    for mode in ("collective", "quiet"):
        (tmp_path / mode).mkdir()
        port = _free_port()
        jobs[mode] = [
            ctx.Process(target=peer_loss_job.run, args=(mode, str(tmp_path / mode), r, port, TIMEOUT_S))
            for r in range(2)
        ]  # fmt: skip
        for job in jobs[mode]:
            job.start()
    deadline = time.monotonic() + 120
    try:
        for job in (j for pair in jobs.values() for j in pair):
            job.join(max(0.0, deadline - time.monotonic()))
    finally:
        for job in (j for pair in jobs.values() for j in pair):
            job.kill() if job.is_alive() else None
    for mode, (survivor, victim) in jobs.items():
        err = (tmp_path / mode / "stderr.rank0").read_text()
        assert victim.exitcode == -9, (mode, victim.exitcode)
        assert survivor.exitcode == (1 if mode == "collective" else 0), (mode, err[-3000:])
        assert "did not complete at exit" in err and "'latest' was not moved" in err, err[-3000:]
        if mode == "collective":  # the failed collective names the lost rank
            assert "rank 1 closed its connection" in err, err[-3000:]
        assert (tmp_path / mode / "ckpt" / "latest").read_text() == "global_step1\n"
        read_metadata(tmp_path / mode / "ckpt" / "global_step1")  # sealed, every file whole
