"""The worker side of the pool: import torch once, then run one test body per message.

A worker is a `spawn`-ed process that imports torch at start-up (the ~2 s we want to pay once
per process, not once per test), sends `("ready", pid)` and then loops on its pipe. For each
task it makes the process look like a fresh torchrun rank, runs the body, and undoes what the task
did to the process before reporting, so the next task starts from the same state:

| phase | what happens |
|---|---|
| before the body | `os.environ` := the caller's environment + `MINISPEED_ACCELERATOR=cpu` + `RANK`/`WORLD_SIZE`/`LOCAL_RANK`/`MASTER_ADDR`/`MASTER_PORT` + the caller's `env=` overrides; cwd and `sys.path` follow the caller's; torch's RNG is reseeded to a fresh process's seed; one thread |
| rendezvous | rank 0 opens a `TCPStore` on port 0 (the OS picks a free port, so no port can be stolen between choosing and binding it) and reports the port; the parent sends it to the other ranks with their task |
| process group | `init_process_group(backend, store=..., timeout=timeout_s + 10 s)` and one barrier (Note [barrier after init]); a collective stuck on a missing peer errors by itself, just after the parent's deadline |
| after the body | `destroy_process_group()` (also after an error); the accelerator choice, grad mode and default dtype are reset |

The worker then reports `("done", Outcome)`. `Outcome.clean` is False when a process group
survived teardown or torch's group counter is not back at 0 (a failed init); the parent then
retires the worker instead of reusing it.

Two safety nets: `SIGINT` is ignored (Ctrl-C goes to the parent, which kills busy workers), and
a watchdog thread exits the worker if its parent disappears, so a killed pytest leaves no orphan
stuck in a collective. `SIGUSR1` makes `faulthandler` write every thread's Python stack to a
file the parent reads when a rank hangs.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

from minispeed.core.testing.function_ref import FunctionRef

__all__ = ["WORKER_ENV", "Outcome", "Task", "worker_main"]

WORKER_ENV = "MINISPEED_TESTING_WORKER"
"""Set to the worker's slot inside pool workers; run_distributed refuses to nest."""

MASTER_ADDR = "127.0.0.1"
_PARENT_POLL_S = 1.0
GROUP_TIMEOUT_MARGIN_S = 10.0
"""Seconds added to timeout_s for the process group (see _group_timeout)."""
WATCHDOG_FUNCTION = "watch_parent"
"""Name of the watchdog thread's function; stack reports leave that thread out."""


@dataclass(frozen=True)
class Task:
    """One rank's share of a run, as sent from the parent to a worker."""

    rank: int
    world_size: int
    fn: FunctionRef
    payload: bytes
    """`pickle.dumps((args, kwargs))`, unpickled after `fn`'s module is loaded (it may define them)."""
    backend: str
    timeout_s: float
    environ: dict[str, str]
    """The complete environment for the body (already includes RANK etc., except MASTER_PORT)."""
    sys_path: list[str]
    cwd: str
    master_port: int | None
    """None for rank 0, which opens the store and reports the port; the port for every other rank."""


@dataclass(frozen=True)
class Outcome:
    """What a worker reports after a task."""

    ok: bool
    result: bytes | None
    """`pickle.dumps` of the body's return value when `ok`."""
    error: str | None
    """The formatted traceback (or unpicklable-result message) when not `ok`."""
    clean: bool
    """No process group is left: the worker may take another task."""


def worker_main(conn: Connection, slot: int, stack_dump_path: str) -> None:
    """Entry point of a pool process (the `spawn` target): import torch, then serve tasks."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ[WORKER_ENV] = str(slot)
    import torch

    torch.set_num_threads(1)
    import torch.distributed

    dump_file = open(stack_dump_path, "w")  # noqa: SIM115  (kept open for faulthandler's lifetime)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    _start_parent_watchdog()
    fresh_seed = torch.initial_seed()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe: nothing more to do
        if message[0] == "stop":
            return
        task: Task = message[1]
        outcome = _run_task(conn, task, fresh_seed)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            conn.send(("done", outcome))
        except (EOFError, OSError):
            return


def _start_parent_watchdog() -> None:
    parent = os.getppid()

    def watch_parent() -> None:
        while True:
            time.sleep(_PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(1)  # orphaned (the parent was killed): a body may be stuck; leave now

    threading.Thread(target=watch_parent, name="minispeed-parent-watchdog", daemon=True).start()


def _group_timeout(task: Task) -> timedelta:
    """The store's and process group's timeout: the run's, plus a margin.

    The parent's deadline (timeout_s) fires first and reports every rank where it is stuck; the
    group's own timeout is the backstop that makes a stuck collective raise even if no parent
    is watching any more.
    """
    return timedelta(seconds=task.timeout_s + GROUP_TIMEOUT_MARGIN_S)


def _prepare_process(task: Task, fresh_seed: int) -> None:
    import torch

    from minispeed.core.accelerator import set_accelerator

    os.environ.clear()
    os.environ.update(task.environ)
    os.environ[WORKER_ENV] = os.environ.get(WORKER_ENV, "1")
    if task.master_port is not None:
        os.environ["MASTER_PORT"] = str(task.master_port)
    for entry in reversed(task.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        os.chdir(task.cwd)
    except OSError:
        pass  # the caller's cwd was removed (a finished tmp_path); keep ours
    torch.manual_seed(fresh_seed)
    torch.set_num_threads(1)
    set_accelerator(None)  # re-detect from MINISPEED_ACCELERATOR on first use


def _rendezvous(conn: Connection, task: Task) -> object:
    """Rank 0 opens the store on a free port and reports it; the others connect to it."""
    import torch.distributed as dist

    timeout = _group_timeout(task)
    if task.rank == 0:
        store = dist.TCPStore(
            MASTER_ADDR, 0, task.world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        os.environ["MASTER_PORT"] = str(store.port)
        conn.send(("port", store.port))
        return store
    assert task.master_port is not None, "ranks > 0 are dispatched with rank 0's port"
    return dist.TCPStore(
        MASTER_ADDR, task.master_port, task.world_size, is_master=False, timeout=timeout
    )


def _teardown() -> bool:
    """Destroy every process group and reset per-process torch state; True if nothing is left.

    "Nothing left" means no group and torch's group counter at 0, so this process's next
    `init_process_group` names its store keys exactly as a fresh process would.
    """
    import torch
    import torch.distributed as dist

    from minispeed.core.accelerator import set_accelerator

    clean = True
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            clean = False
    # A failed init advances the group counter without creating a group; see Note [which
    # workers are reused] in pool.py.
    if dist.is_initialized() or dist.get_pg_count() != 0:
        clean = False
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
    set_accelerator(None)
    return clean


def _format_body_error(exc: BaseException) -> str:
    """The traceback without this module's own frame on top (it is the same in every report)."""
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _run_task.__code__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


# Note [barrier after init]
#     Gloo's init finishes on each rank when *its* side of the connections is up. Without a
#     barrier, rank 0 can run a body with no collectives, destroy its group and close the store
#     while rank 1 is still connecting: rank 1 then fails with "Connection closed by peer". One
#     barrier (a few messages) makes every rank leave init only once all ranks are connected.


def _run_task(conn: Connection, task: Task, fresh_seed: int) -> Outcome:
    import torch.distributed as dist

    store = None
    try:
        _prepare_process(task, fresh_seed)
        fn = task.fn.resolve()
        args, kwargs = pickle.loads(task.payload)
        store = _rendezvous(conn, task)
        dist.init_process_group(
            task.backend,
            store=store,
            rank=task.rank,
            world_size=task.world_size,
            timeout=_group_timeout(task),
        )
        # See Note [barrier after init].
        dist.barrier()
        value = fn(task.rank, task.world_size, *args, **kwargs)
    except BaseException as exc:  # pytest.fail() raises a BaseException; report it like any failure
        error = _format_body_error(exc)
        del store
        return Outcome(ok=False, result=None, error=error, clean=_teardown())
    del store
    clean = _teardown()
    try:
        data = pickle.dumps(value)
    except Exception as exc:
        error = (
            f"rank {task.rank} returned a value that cannot be pickled "
            f"({type(value).__name__}): {type(exc).__name__}: {exc}\n"
            "Return plain Python values or CPU tensors (tensor.detach().cpu()).\n"
        )
        return Outcome(ok=False, result=None, error=error, clean=clean)
    return Outcome(ok=True, result=data, error=None, clean=clean)
