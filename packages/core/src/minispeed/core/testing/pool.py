"""The parent side: a pool of warm worker processes, and the loop that watches one run.

Note [why a pool]
    Importing torch costs about 2.3 s of CPU per process here, and a distributed test suite runs
    hundreds of bodies on 2 or 4 ranks. Fresh processes per run would spend most of the suite
    importing torch: every 2-rank run would cost 2 × 2.3 s of CPU before its first line. The
    pool pays one import per slot once per pytest session; after that a run costs a
    rendezvous, one barrier and the body. Measured on the 2-core dev box shared with other
    jobs, 10 trivial 2-rank runs in a row: 0.32 s warm (32 ms each) against 78.5 s with fresh
    processes per run (7.9 s each: spawn + torch import) at load ~5; 0.48 s against 263 s at
    load ~11. The cold first run costs what one fresh run does.
    Memory cost: ~230 MB RSS per slot, alive until the parent exits (or shutdown_pool()).

    The pool is one list of slots, not one pool per world size: a 2-rank run uses slots 0-1 of
    the same processes a 4-rank run uses, so tests parametrized over [2, 4] keep 4 processes
    alive, not 6.

Note [how a run is watched]
    The parent waits with `multiprocessing.connection.wait` on every busy worker's pipe *and*
    its process sentinel, so three things wake it at once: a message, a process exit, the
    deadline. The deadline is `timeout_s` after the tasks were sent (pool start-up has its
    own, longer limit and does not eat into it). The first failure (a rank raised, or a process
    exited while it owed a reply) starts a grace period of GRACE_AFTER_FAILURE_S for the other
    ranks: gloo fails their pending collectives as soon as the failed rank's connections close,
    so they usually report at once; the ones still running when it ends are killed. So a crash
    is reported within seconds, never at the timeout.

Note [which workers are reused]
    A worker is reused only if it reported `done` with a clean teardown: no process group
    initialized and torch's group counter back at 0. The counter matters: a failed gloo init
    leaves it advanced, and that process's next init then names its store keys with another
    prefix and waits forever for its peers (seen under load, when a peer closed early). Every
    other busy worker (hung, died, unclean) is marked SUSPECT, its stack dumped if it still
    runs, then terminated (SIGTERM, then SIGKILL after 2 s), and a replacement is spawned at
    once, in the background, so its torch import overlaps the caller's error handling. A rank
    whose body raised but tore down cleanly is reused (what a body does to its own module
    globals is its business, as in any single-process test). An `atexit` hook, daemon
    processes, and a parent-death watchdog in each worker leave no orphans.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import shutil
import tempfile
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from minispeed.core.testing.errors import DistributedTestError, describe_exit, format_failure
from minispeed.core.testing.process import KILL_WAIT_S, WorkerProcess, WorkerState
from minispeed.core.testing.worker import Outcome, Task

__all__ = ["WorkerPool", "get_pool", "shutdown_pool"]

STARTUP_TIMEOUT_S = 300.0
"""Limit for spawning workers (torch import); generous because the machine may be loaded."""
GRACE_AFTER_FAILURE_S = 5.0
"""How long the other ranks may take to report after the first failure."""


class WorkerPool:
    """Warm worker processes, one per rank slot, shared by every run in this process.

    Costs: `max world size` processes, each paying one torch import at start-up and holding
    that memory until `close` (called at interpreter exit). Not re-entrant: one run at a
    time (a lock serializes threads).
    """

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: dict[int, WorkerProcess] = {}
        self._lock = threading.Lock()
        self._dump_dir = tempfile.mkdtemp(prefix="minispeed-testing-")

    # -- lifecycle -------------------------------------------------------------------------

    def worker_pids(self) -> dict[int, int]:
        """`{slot: pid}` of the live idle workers (to check reuse in tests)."""
        return {s: w.process.pid for s, w in self._workers.items() if w.state is WorkerState.IDLE}

    def close(self) -> None:
        """Stop every worker (politely if idle, by force otherwise) and remove the dump files."""
        with self._lock:
            for worker in self._workers.values():
                if worker.state is WorkerState.IDLE:
                    with contextlib.suppress(OSError):
                        worker.send(("stop",))
            for worker in self._workers.values():
                if worker.state is WorkerState.IDLE:
                    worker.process.join(KILL_WAIT_S)
                worker.kill()
            self._workers.clear()
            shutil.rmtree(self._dump_dir, ignore_errors=True)

    def _ensure(self, world_size: int) -> list[WorkerProcess]:
        """Slots `0..world_size-1` as IDLE live workers, spawning replacements as needed."""
        starting: list[WorkerProcess] = []
        for slot in range(world_size):
            worker = self._workers.get(slot)
            if worker is not None and worker.process.is_alive():
                if worker.state is WorkerState.IDLE:
                    continue
                if worker.state is WorkerState.STARTING:  # a replacement started in advance
                    starting.append(worker)
                    continue
            if worker is not None:
                worker.kill()
            worker = WorkerProcess(self._ctx, slot, self._dump_dir)
            self._workers[slot] = worker
            starting.append(worker)
        self._await_ready(starting)
        return [self._workers[slot] for slot in range(world_size)]

    def _await_ready(self, starting: list[WorkerProcess]) -> None:
        """Wait for `ready` from each new worker; a worker that exits first is an error."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = {w.conn: w for w in starting}
        by_sentinel = {w.process.sentinel: w for w in starting}
        while waiting:
            remaining = deadline - time.monotonic()
            ready = wait([*waiting, *(w.process.sentinel for w in waiting.values())], remaining)
            if not ready:
                for worker in starting:
                    worker.kill()
                raise DistributedTestError(
                    f"test workers did not start within {STARTUP_TIMEOUT_S:g} s (importing torch); "
                    "the machine may be overloaded: retry, or run fewer tests in parallel"
                )
            for obj in ready:
                worker = waiting.get(obj) or by_sentinel.get(obj)  # type: ignore[call-overload]
                if worker is None or worker.conn not in waiting:
                    continue
                message = None
                try:
                    if worker.conn.poll():  # also true at EOF, where recv raises
                        message = worker.conn.recv()
                except (EOFError, OSError):
                    pass
                if message is not None and message[0] == "ready":
                    worker.to_idle()
                    del waiting[worker.conn]
                    continue
                code = worker.exitcode_after_exit()  # exited (or exiting) without "ready"
                worker.kill()
                raise DistributedTestError(
                    f"test worker for slot {worker.slot} died during start-up "
                    f"({describe_exit(code)}); its stderr above says why"
                )

    # -- one run ---------------------------------------------------------------------------

    def run(self, make_task: Any, world_size: int, timeout_s: float, label: str) -> list[bytes]:
        """Run `make_task(rank, master_port)` on ranks `0..world_size-1`; pickled results.

        Raises `DistributedTestError` describing every failing rank. See Note [how a run
        is watched].
        """
        with self._lock:
            workers = self._ensure(world_size)
            try:
                return self._watch(workers, make_task, world_size, timeout_s, label)
            except BaseException:
                # Ctrl-C or a bug here: nothing guarantees the busy workers are clean.
                for worker in workers:
                    if worker.state is WorkerState.BUSY:
                        worker.to_suspect()
                        worker.kill()
                raise

    def _watch(
        self,
        workers: list[WorkerProcess],
        make_task: Any,
        world_size: int,
        timeout_s: float,
        label: str,
    ) -> list[bytes]:
        deadline = time.monotonic() + timeout_s
        results: dict[int, bytes] = {}
        tracebacks: dict[int, str] = {}  # insertion order = order of failure
        exit_codes: dict[int, int] = {}
        not_started = set(range(1, world_size))
        pending: set[int] = set()  # dispatched, no "done" yet, not known dead
        closed: set[int] = set()  # pipe at EOF: the process is exiting, its sentinel will fire
        first_failure_at: float | None = None
        first_failure: str | None = None  # e.g. "rank 1 raised"

        def dispatch(rank: int, port: int | None) -> None:
            task: Task = make_task(rank, port)
            workers[rank].to_busy()
            pending.add(rank)
            try:
                workers[rank].send(("run", task))
            except OSError:
                pass  # the process is gone; its sentinel reports it below

        def note_failure(what: str) -> None:
            nonlocal first_failure_at, first_failure
            if first_failure is None:
                first_failure_at, first_failure = time.monotonic(), what

        def receive(rank: int) -> None:
            try:
                message = workers[rank].conn.recv()
            except (EOFError, OSError):
                closed.add(rank)
                return
            if message[0] == "port":
                for other in sorted(not_started):
                    dispatch(other, message[1])
                not_started.clear()
            elif message[0] == "done":
                outcome: Outcome = message[1]
                pending.discard(rank)
                workers[rank].to_idle()
                if not outcome.clean:
                    workers[rank].to_suspect()  # See Note [which workers are reused]
                if outcome.ok:
                    assert outcome.result is not None
                    results[rank] = outcome.result
                else:
                    tracebacks[rank] = outcome.error or "(no traceback)"
                    note_failure(f"rank {rank} raised")

        dispatch(0, None)
        while pending:
            limit = deadline
            if first_failure_at is not None:
                limit = min(deadline, first_failure_at + GRACE_AFTER_FAILURE_S)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            by_conn = {workers[r].conn: r for r in pending - closed}
            by_sentinel = {workers[r].process.sentinel: r for r in pending}
            ready = wait([*by_conn, *by_sentinel], remaining)
            for obj in ready:
                if obj in by_conn and by_conn[obj] in pending:  # type: ignore[index]
                    receive(by_conn[obj])  # type: ignore[index]
            for obj in ready:
                rank = by_sentinel.get(obj)  # type: ignore[call-overload]
                if rank is None:
                    continue
                # The process exited: read what it sent before exiting (a pipe at EOF also polls
                # as readable, hence the `closed` check), then, if it still owes "done", it died.
                while rank in pending and rank not in closed and workers[rank].conn.poll():
                    receive(rank)
                if rank in pending:
                    exit_codes[rank] = workers[rank].exitcode_after_exit()  # type: ignore[assignment]
                    pending.discard(rank)
                    workers[rank].to_suspect()
                    # Its peers now fail fast (gloo sees the closed connection) or are stuck:
                    # either way the grace period, not the timeout, bounds the wait.
                    note_failure(f"rank {rank} died ({describe_exit(exit_codes[rank])})")

        timed_out = bool(pending) and not exit_codes and time.monotonic() >= deadline
        if not (pending or tracebacks or exit_codes or not_started):
            self._retire_suspects(workers)
            return [results[rank] for rank in range(world_size)]

        stacks = {}
        for rank in sorted(pending):
            workers[rank].to_suspect()
            stacks[rank] = workers[rank].dump_stack()
        self._retire_suspects(workers)
        message = format_failure(
            label,
            world_size,
            first_failure=first_failure,
            tracebacks=tracebacks,
            exit_codes=exit_codes,
            finished=results,
            unfinished=pending,
            not_started=not_started,
            stacks=stacks,
            timeout_s=timeout_s,
            timed_out=timed_out,
        )
        raise DistributedTestError(
            message,
            tracebacks=tracebacks,
            exit_codes=exit_codes,
            finished=results,
            unfinished=pending,
            timed_out=timed_out,
        )

    def _retire_suspects(self, workers: list[WorkerProcess]) -> None:
        """Kill SUSPECT workers and start their replacements now, without waiting for them.

        The replacement imports torch while the caller reports the failure and pytest moves on,
        so the next run usually finds it ready.
        """
        for worker in workers:
            if worker.state is WorkerState.SUSPECT:
                worker.kill()
                self._workers[worker.slot] = WorkerProcess(self._ctx, worker.slot, self._dump_dir)


_pool: WorkerPool | None = None
_pool_lock = threading.Lock()
_atexit_registered = False


def get_pool() -> WorkerPool:
    """The process-wide pool, created on first use; closed at interpreter exit."""
    global _pool, _atexit_registered
    with _pool_lock:
        if _pool is None:
            _pool = WorkerPool()
            if not _atexit_registered:
                atexit.register(shutdown_pool)
                _atexit_registered = True
        return _pool


def shutdown_pool() -> None:
    """Stop all pool workers now (they are re-spawned on next use). Safe to call twice."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.close()
