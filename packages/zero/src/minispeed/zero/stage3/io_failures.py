"""ZeRO-Infinity's file I/O fails on every rank as one clear error, never as a wait.

Reading order: Note [an I/O failure fails every rank], then `IOFailures` (what a rank records,
and the two ways the ranks agree on it), then `OffloadIOError` (what every rank raises).

Where the I/O is and where its failure is agreed (each row is one kind of I/O; the agreement
is the first collective after it that every rank runs):

| I/O (the file) | between collectives? | agreed at |
|---|---|---|
| parameter fetch in forward / backward (param shard) | yes: zeros instead | the step's agreement flags |
| gradient shard write, read-add-write (grad file) | yes: skipped | the step's agreement flags |
| optimizer step: read / step / write (partition file) | no | end of the step (publish) |
| new masters into the parameter shards (shard file) | no | end of the step (publish) |
| `zero.Init(config)` writing each shard | yes: recorded | the end of `Init` |
| `zero.shard` writing the first masters | no | the end of `zero.shard` |
| `GatheredParameters`, `full_state_dict`, checkpoints | yes: zeros instead | the context's entry |
| `close()` gathering the model back | yes: zeros instead | the end of `close()` |

Checkpoint files themselves are covered by `checkpoints.agree.together`.

Note [an I/O failure fails every rank]
With ZeRO-Infinity the ranks read and write swap files between the collectives of a step. A
read or write that fails on ONE rank (a swap file deleted or truncated, a full disk, EIO) must
not make that rank leave the step: the others would wait in their next collective until comm's
timeout fires. So every file operation runs under `IOFailures.guard`: an `OSError` is *recorded*
(which rank, what it was doing, the OS error, which names the file) and the rank goes on with
a placeholder (a shard read as zeros, a gradient write skipped), taking part in every
collective the others run. Nothing computed from a placeholder is ever stepped:

- failures *between* collectives (forward, backward) travel in the agreement flags the step
  already all-reduces (`ZeroOptimizer`, Note [unused parameters]): one more fp32 slot, so
  they cost no collective of their own, and every rank raises before any master changes;
- failures *inside* the step (the read/step/write pipeline, publishing the new masters): the
  failing rank stops its local I/O (`run` skips the rest once a failure is recorded) and every
  rank agrees at the end of the step in one 1-element fp32 all-reduce (`agree`): 4 bytes of
  payload, ``2·(N-1)/N·4`` bytes sent per rank by a ring. A failure found there leaves the
  other ranks stepped and this one not, so the error says to resume from a checkpoint.

Only when some rank failed do the ranks exchange the details (one ``all_gather_object`` of a
few hundred bytes per rank), so that every rank's `OffloadIOError` names every failing rank,
its files and its OS errors. The failing rank chains its first `OSError` as the cause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

import minispeed.comm as comm
from minispeed.core.logging import get_logger

__all__ = ["IOFailures", "OffloadIOError"]

_log = get_logger("zero.offload")
_SHOWN = 3  # failures per rank spelled out in the message (the first is the cause)


class OffloadIOError(OSError):
    """A swap-file read or write failed on some rank under ZeRO-Infinity; raised on EVERY rank.

    The message names each failing rank, what it was doing, and its OS error (which names the
    file). An `OSError`, so code that catches file errors catches it too.
    """


class IOFailures:
    """This rank's failed file operations, and the agreement that turns them into an error.

    Shared by everything that does Infinity I/O for one model (the parameter shards' home, the
    optimizer's partition and gradient files). See Note [an I/O failure fails every rank].
    """

    def __init__(self) -> None:
        self.failures: list[tuple[str, OSError]] = []  # (what this rank was doing, the error)
        # Called by `settle` (under `guard`): finish writes in flight, so that their errors are
        # known before an agreement instead of after it.
        self.settlers: list[Callable[[], None]] = []

    @property
    def failed(self) -> bool:
        """Whether an operation failed since the last agreement."""
        return bool(self.failures)

    def record(self, what: str, error: OSError) -> None:
        """Remember that ``what`` failed with ``error``; the rank carries on (placeholders)."""
        _log.error("ZeRO-Infinity I/O failed (%s): %s; every rank raises at the next agreement",
                   what, error)  # fmt: skip
        self.failures.append((what, error))

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Run the body; an `OSError` in it is recorded and swallowed (the caller then supplies
        a placeholder)."""
        try:
            yield
        except OSError as error:
            self.record(what, error)

    def run(self, what: str, fn: Callable[[], Any]) -> bool:
        """Local work of a step: ``fn()`` under `guard`, skipped once a failure is recorded (the
        swap state after a failed step is not trusted). Returns whether it ran and succeeded."""
        if self.failed:
            return False
        with self.guard(what):
            fn()
            return True
        return False

    def settle(self) -> None:
        """Wait for the writes in flight (`settlers`), recording their failures."""
        for wait in self.settlers:
            with self.guard("finishing the writes in flight"):
                wait()

    def agree(self, group: Any, where: str) -> None:
        """Collective: one 1-element fp32 all-reduce (MAX) of "failed"; if any rank failed, every
        rank raises `OffloadIOError` (see `raise_everywhere`)."""
        flag = torch.tensor([float(self.failed)], device=comm.tensor_device(group))
        comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=group)
        if flag.item() > 0:
            self.raise_everywhere(group, where)

    def raise_everywhere(self, group: Any, where: str) -> NoReturn:
        """Collective, once some rank is known to have failed: exchange the failures (one
        ``all_gather_object``), forget them, and raise the same `OffloadIOError` on every rank."""
        shown = [f"{what}: {error}" for what, error in self.failures[:_SHOWN]]
        if len(self.failures) > _SHOWN:
            shown.append(f"and {len(self.failures) - _SHOWN} more")
        cause = self.failures[0][1] if self.failures else None
        self.failures = []
        gathered = comm.all_gather_object((comm.get_rank(), shown), group=group)
        raise OffloadIOError(_message(where, gathered)) from cause


def _message(where: str, gathered: list[tuple[int, list[str]]]) -> str:
    failed = [(rank, shown) for rank, shown in gathered if shown]
    ranks = [rank for rank, _ in failed]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    details = "; ".join(f"rank {rank}: " + "; ".join(shown) for rank, shown in failed)
    return (
        f"ZeRO-Infinity: a swap-file read or write failed on {who} of {len(gathered)} (found at "
        f"{where}; every rank raises this error). {details}. No rank stepped with a failed read's "
        f"placeholder, but the swap files are no longer consistent across ranks: check the disk "
        f"behind nvme_path (free space, permissions, swap files deleted or truncated under the "
        f"job), then restart the job and resume from the last checkpoint (zero.load_checkpoint)"
    )
