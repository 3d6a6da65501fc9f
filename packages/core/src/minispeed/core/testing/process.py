"""The parent's handle on one worker process: spawn it, talk to it, dump its stack, kill it.

Each handle owns one `spawn`-ed process running `worker_main`, the parent's end
of a duplex pipe to it, and the file its `faulthandler` writes stacks to. Its state is an
explicit `WorkerState`, changed only by `to_<state>()` methods that assert the legal
source state, so the pool cannot reuse a worker it has stopped trusting.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import sys
import time
import types
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

from minispeed.core.testing import worker as worker_module
from minispeed.core.testing.errors import trim_stack_dump
from minispeed.core.testing.worker import worker_main

__all__ = ["WorkerProcess", "WorkerState"]

KILL_WAIT_S = 2.0
"""How long terminate() and kill() each wait for the process to exit."""
_STACK_WAIT_S = 1.0


class WorkerState(enum.Enum):
    """Lifecycle of one worker process (see Note [which workers are reused] in pool.py).

    STARTING: spawned, importing torch, has not sent `ready`.
    IDLE: waiting on its pipe; no process group exists; may take a task.
    BUSY: owns a task and owes a `done` message.
    SUSPECT: did not come back clean (hung, died, or kept a group); will be killed, never reused.
    DEAD: terminated and reaped; its slot is re-spawned on next use.
    """

    STARTING = "starting"
    IDLE = "idle"
    BUSY = "busy"
    SUSPECT = "suspect"
    DEAD = "dead"


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start a process without `spawn` re-running the caller's `__main__` in it.

    Note [workers do not re-import __main__]
        `spawn` normally re-executes the parent's main script in every child, which breaks a
        script that calls run_distributed at top level (no `if __name__ == "__main__"` guard)
        and costs whatever the script imports. Workers need nothing from `__main__` (bodies are
        found by FunctionRef), so while `Process.start()` reads the main module we show it a
        stand-in with no file and no spec. Only a body defined in `__main__` itself makes the
        worker load the script (under another name, so its guard still holds).
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class WorkerProcess:
    """One pool process, its pipe, and its state."""

    def __init__(self, ctx: Any, slot: int, dump_dir: str) -> None:
        self.slot = slot
        self.stack_dump_path = os.path.join(dump_dir, f"stack-{slot}-{time.monotonic_ns()}.txt")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=worker_main,
            args=(child_conn, slot, self.stack_dump_path),
            name=f"minispeed-test-worker-{slot}",
            daemon=True,
        )
        with _main_module_hidden():
            self.process.start()
        child_conn.close()
        self.conn: Connection = parent_conn
        self.state = WorkerState.STARTING

    def to_idle(self) -> None:
        assert self.state in (WorkerState.STARTING, WorkerState.BUSY), self.state
        self.state = WorkerState.IDLE

    def to_busy(self) -> None:
        assert self.state is WorkerState.IDLE, self.state
        self.state = WorkerState.BUSY

    def to_suspect(self) -> None:
        assert self.state is not WorkerState.DEAD, self.state
        self.state = WorkerState.SUSPECT

    def send(self, message: tuple) -> None:
        self.conn.send(message)

    def exitcode_after_exit(self) -> int | None:
        """Reap the process (it has exited: its sentinel fired) and return its exit code."""
        self.process.join(KILL_WAIT_S)
        return self.process.exitcode

    def dump_stack(self) -> str:
        """Ask a live worker for its Python stacks (faulthandler on SIGUSR1) and read them back."""
        if not hasattr(signal, "SIGUSR1") or not self.process.is_alive():
            return ""
        try:
            os.kill(self.process.pid, signal.SIGUSR1)
        except OSError:
            return ""
        deadline = time.monotonic() + _STACK_WAIT_S
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with contextlib.suppress(OSError), open(self.stack_dump_path) as f:
                new = f.read()
            if new and new == text:
                break  # unchanged for one poll: the dump is complete
            text = new
        return trim_stack_dump(text, worker_module.__file__, worker_module.WATCHDOG_FUNCTION)

    def kill(self) -> None:
        """Terminate, then kill; reap the process and close the pipe. Idempotent."""
        if self.state is WorkerState.DEAD:
            return
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(KILL_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(KILL_WAIT_S)
        self.conn.close()
        with contextlib.suppress(OSError):
            os.remove(self.stack_dump_path)
        self.state = WorkerState.DEAD
