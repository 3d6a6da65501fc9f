"""Saving and loading fail on every rank or on none: each local phase ends in an agreement.

Note [a checkpoint fails on every rank]
Saving and loading alternate between *local* work (writing or reading this rank's files) and
*collectives* (gathering what the other ranks hold). An exception in the local work of one rank
(a full disk, a damaged file, a model that does not match) would leave that rank raising and
every other rank waiting in the next collective, forever. So every local phase runs inside
`together`: it catches the exception, and every rank then exchanges its outcome in one
``all_gather_object`` (8 + a few hundred bytes per rank). If any rank failed, every rank raises
the same `CheckpointError` naming the ranks and their errors
(the failing rank chains its own exception as the cause). Collectives are never inside a phase,
so a rank that fails cannot skip one that the others run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import minispeed.comm as comm
from minispeed.zero.checkpoints.layout import CheckpointError

__all__ = ["together"]

T = TypeVar("T")


def together(
    group: Any,
    what: str,
    fn: Callable[[], T],
    share: Callable[[T], Any] | None = None,
) -> tuple[T, list[Any]]:
    """Run the local phase ``fn`` on this rank, then agree with every rank on its outcome.

    Returns ``(fn's result, [share(result) of every rank, in rank order])`` when every rank
    succeeded (``share`` defaults to sharing nothing). Raises on every rank otherwise. Costs one
    ``all_gather_object`` of the shared values. See Note [a checkpoint fails on every rank].
    """
    result: Any = None
    error: BaseException | None = None
    try:
        result = fn()
        payload: tuple[str | None, Any] = (None, share(result) if share is not None else None)
    except Exception as e:  # reported to every rank below, then raised here too
        error = e
        payload = (_describe(e), None)
    gathered = comm.all_gather_object(payload, group=group)
    failures = [(rank, message) for rank, (message, _) in enumerate(gathered) if message]
    if failures:
        raise CheckpointError(_summary(what, failures, len(gathered))) from error
    return result, [shared for _, shared in gathered]


def _describe(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def _summary(what: str, failures: list[tuple[int, str]], world_size: int) -> str:
    ranks = [rank for rank, _ in failures]
    messages = list(dict.fromkeys(message for _, message in failures))
    where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    if len(messages) == 1:
        return f"{what} failed on {where} of {world_size}: {messages[0]}"
    details = "; ".join(f"rank {rank}: {message}" for rank, message in failures)
    return f"{what} failed on {where} of {world_size}: {details}"
