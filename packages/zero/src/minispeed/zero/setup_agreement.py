"""Set-up checks that can differ between ranks fail on every rank, before any collective.

Note [a set-up check fails on every rank]
Some of `zero.shard`'s set-up depends on the rank's own machine: whether `nvme_path` exists and
is writable there, how much space its file system has, whether its buffers can be page-locked.
A check that fails on ONE rank must not make that rank raise alone: the others would go on into
the next collective (an all-gather, a step) and get an unrelated `CommBackendError`, or wait for
as long as the failing rank lives. So the local set-up runs inside `agree_on_setup`: an
exception is caught, and every rank then takes part in one 1-element fp32 all-reduce (MAX) of
"failed" (4 bytes). Only when some rank failed do the ranks exchange their messages (one
``all_gather_object``, a few hundred bytes per rank), and every rank raises the same
`OffloadSetupError`, naming each failing rank and its error (which names the key and the fix);
the failing rank chains its own exception as the cause. The local set-up holds no collective,
so a rank that fails cannot skip one that the others run. What the healthy ranks built (swap
files) is released before they raise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

import minispeed.comm as comm

__all__ = ["OffloadSetupError", "agree_on_setup"]

T = TypeVar("T")


class OffloadSetupError(RuntimeError):
    """A per-rank set-up check (a path, free space, page-locking) failed on some rank; raised on
    EVERY rank, with the same message naming each failing rank, its error and the fix."""


def agree_on_setup(
    group: Any,
    what: str,
    build: Callable[[], T],
    discard: Callable[[T], None] | None = None,
) -> T:
    """Run the local set-up ``build`` on this rank, then agree with every rank on its outcome.

    Returns ``build()``'s result when every rank succeeded. Otherwise every rank raises
    `OffloadSetupError`; a rank that built something first passes it to ``discard`` (its errors
    are ignored: the set-up error is the one to report). Costs one 1-element all-reduce, plus
    one ``all_gather_object`` only after a failure. See Note [a set-up check fails on every rank].
    """
    result: Any = None
    error: Exception | None = None
    try:
        result = build()
    except Exception as exc:  # reported to every rank below, then raised here too
        error = exc
    flag = torch.tensor([float(error is not None)], device=comm.tensor_device(group))
    comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=group)
    if flag.item() == 0:
        return result
    if error is None and discard is not None:
        with contextlib.suppress(Exception):
            discard(result)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    gathered = comm.all_gather_object((comm.get_rank(), mine), group=group)
    raise OffloadSetupError(_summary(what, gathered)) from error


def _summary(what: str, gathered: list[tuple[int, str | None]]) -> str:
    failed = [(rank, message) for rank, message in gathered if message]
    ranks = [rank for rank, _ in failed]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    messages = list(dict.fromkeys(message for _, message in failed))
    if len(messages) == 1:
        details = messages[0]
    else:
        details = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
    return (
        f"{what} failed on {who} of {len(gathered)} (every rank raises this error; nothing was "
        f"trained): {details}. The check ran on each rank's own machine: fix it where it failed"
    )
