"""Run a benchmark's worker on N local processes and collect what each rank reports."""

from __future__ import annotations

import queue as queues
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the workers' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker: Callable, world: int, *extra: Any) -> dict[int, Any]:
    """Start ``worker(rank, world, port, *extra, queue)`` on `world` spawned processes and return
    {rank: result}, each worker putting ``(rank, result)`` on the queue once. A rank that dies
    stops the run (the others are killed) instead of leaving the parent waiting forever."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *extra, queue)) for r in range(world)]
    for pr in procs:
        pr.start()
    results: dict[int, Any] = {}
    while len(results) < len(procs):
        try:
            rank, res = queue.get(timeout=5)
            results[rank] = res
        except queues.Empty:
            dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
            if dead:
                for pr in procs:
                    pr.kill()
                raise SystemExit(
                    f"benchmark rank(s) {dead} failed; see their tracebacks above"
                ) from None
    for pr in procs:
        pr.join()
        if pr.exitcode != 0:
            raise SystemExit(f"a benchmark process exited with code {pr.exitcode}")
    return results
