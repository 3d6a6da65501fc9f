"""Process groups: start torch.distributed, ask ranks and sizes, make sub-groups.

Every rank of the world calls `new_group` for every group, in the same order (a torch
requirement: group creation is itself collective). `minispeed.comm.topology` does that for
a whole process grid.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from minispeed.comm import handoff, validation
from minispeed.comm.validation import CommInputError
from minispeed.core.accelerator import get_accelerator
from minispeed.core.logging import get_logger

__all__ = [
    "collective_timeout_s",
    "destroy_process_group",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "is_member",
    "new_group",
    "world_group",
]

_log = get_logger("comm")


def init_distributed(
    backend: str | None = None,
    timeout_s: float = 300.0,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> None:
    """Initialize the default process group from torchrun's environment; no-op if already done.

    `backend=None` asks the accelerator (gloo on CPU, nccl on GPU). Reads `RANK`,
    `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`. Without them (a plain
    `python script.py`) it starts a single-process group, so the same script runs unlaunched.
    On a GPU the process's device is set to `LOCAL_RANK`. An explicit rendezvous gives `rank`
    and `world_size` (both, with `0 <= rank < world_size`) and `init_method` (torch's:
    `"file:///shared/path"`, `"tcp://host:port"`; `"env://"` reads `MASTER_ADDR`/`MASTER_PORT`).

    A script that never calls `destroy_process_group` (most DeepSpeed scripts) gets it called
    for it when the interpreter exits cleanly: Note [destroy before finalization].
    """
    global _timeout_s
    _register_exit_teardown()  # also for a group the script started itself
    if dist.is_initialized():
        return
    acc = get_accelerator()
    backend = backend or acc.communication_backend()
    timeout = datetime.timedelta(seconds=timeout_s)
    _timeout_s = timeout_s
    if rank is not None or world_size is not None:
        if rank is None or world_size is None or not 0 <= rank < world_size:
            raise CommInputError(
                f"init_distributed(rank={rank}, world_size={world_size}): give both, with "
                "0 <= rank < world_size (or neither, to read torchrun's RANK/WORLD_SIZE)"
            )
        if acc.name != "cpu":
            acc.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(
            backend,
            init_method=init_method or "env://",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if acc.name != "cpu":
            acc.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout)
    elif init_method is not None:
        raise CommInputError(
            "init_distributed: init_method given but RANK/WORLD_SIZE are not set; launch with "
            "torchrun or export RANK and WORLD_SIZE"
        )
    else:
        _log.info("RANK/WORLD_SIZE not set: starting a single-process group (world size 1)")
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)


# Note [destroy before finalization]
# A process that exits with the default group alive leaves gloo's worker threads to be torn
# down during interpreter finalization, so the first `init_distributed` registers an exit hook
# that settles every collective's loan (`handoff.settle_all`) and destroys the group while the
# interpreter is still whole. What made the exit abort (`terminate called without an active
# exception`) was a worker thread releasing a tensor's Python object after finalization began;
# since every collective returns only when the backend has let go of its tensors (Note [the
# backend lets go before we do] in handoff.py), none is left to release, also for a group that
# outlives its destruction because an object still holds it. Only on a clean exit: after an
# uncaught exception (`sys.last_value` is set) a rank may hold work its dead peer will never
# complete, and tearing the group down would wait for it; the process then exits as it would
# have.


_exit_teardown_registered = False


def _register_exit_teardown() -> None:
    global _exit_teardown_registered
    if not _exit_teardown_registered:
        atexit.register(_destroy_at_exit)
        _exit_teardown_registered = True


def _destroy_at_exit() -> None:
    if getattr(sys, "last_value", None) is not None or not is_initialized():
        return
    try:
        handoff.settle_all()
        dist.destroy_process_group()
    except Exception as err:  # exiting anyway: say so, never mask the exit status
        _log.warning("destroying the process group at exit failed: %s", err)


_timeout_s: float | None = None  # what init_distributed gave the default group


def collective_timeout_s() -> float:
    """How long a collective of the default group waits for a peer before failing, in seconds:
    `init_distributed`'s `timeout_s`, or torch's default for a group the script started itself.
    Also the bound on waiting for other ranks outside a collective (a background checkpoint's
    done markers at exit)."""
    if _timeout_s is not None:
        return _timeout_s
    return default_pg_timeout.total_seconds()


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def destroy_process_group(group: Any = None) -> None:
    """Tear down `group` (everything when `None`), once the backend has let go of every
    collective's tensors (`handoff.settle_all`)."""
    handoff.settle_all()
    dist.destroy_process_group(group)


def get_rank(group: Any = None) -> int:
    """This process's rank in `group` (global rank for `None`); -1 if it is not a member."""
    validation.check_group("get_rank", None)
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """Number of ranks in `group` (the world for `None`); -1 if this rank is not a member."""
    validation.check_group("get_world_size", None)
    return dist.get_world_size(group)


def world_group() -> Any:
    """The default process group itself (torch's `group.WORLD`), for APIs that want a group
    object rather than `None`; a new object each time the process group is initialized."""
    return dist.group.WORLD


def is_member(group: Any) -> bool:
    """Whether this rank belongs to `group` (`None`, the world, always)."""
    return group is None or dist.get_world_size(group) > 0


def new_group(
    ranks: Sequence[int] | None = None, timeout_s: float | None = None, backend: str | None = None
) -> Any:
    """A process group over global `ranks` (all ranks when `None`).

    Collective: EVERY rank of the world must call it, with the same `ranks`, in the same order
    as other `new_group` calls, members or not. Non-members get a handle they may not use for
    collectives (`is_member` says which).
    """
    validation.check_group("new_group", None)
    kwargs: dict[str, Any] = {"ranks": None if ranks is None else sorted(int(r) for r in ranks)}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    if backend is not None:
        kwargs["backend"] = backend
    world = dist.get_world_size()
    bad = [r for r in (kwargs["ranks"] or []) if not 0 <= r < world]
    if bad:
        raise CommInputError(f"new_group: ranks {bad} are outside the world [0, {world})")
    return dist.new_group(**kwargs)
