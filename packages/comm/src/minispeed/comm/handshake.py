"""The cross-rank check before a collective: which calls are checked, and how cheaply.

A collective whose ranks disagree (10 elements against 12, fp32 against int32, all_reduce
against broadcast) does not fail cleanly in the backend: gloo aborts one rank and hands the
other a wrong result, or both get garbage. So ranks compare their calls before the real one,
in one of three modes (`MINISPEED_COMM_VALIDATE` in the environment, or
`comm.validation_mode(...)` around the calls):

| mode | value | which calls are checked | cost per call |
|---|---|---|---|
| off | `0`, `off`, `false`, `no` | none | nothing |
| first (default) | unset, `first` | the first call of each call site | one dict lookup; the checked call adds one all-gather of 16 bytes per rank |
| all | `1`, `all`, `true`, `yes`, `on` | every call | one all-gather of 16 bytes per rank |

**The fingerprint.** A checked call all-gathers two int64 per rank: a status (0, or 1 when this
rank rejected its own arguments) and a CRC-32 of `(op, signature)`, where the signature holds
what must agree across ranks (shape, dtype, reduce op, root). Equal fingerprints and no failed
rank: the real collective runs. Otherwise every rank sees the same gathered table, so every rank
takes the slow path together (`validation.compare_in_full`, beside the error it builds): an
object all-gather of the full signatures and error texts, then the same `CommMismatchError` on every rank (or, where a rank rejected its arguments, a
`CommInputError` on its peers quoting that rank's error). This traffic is diagnostic, not the
program's: it goes straight to torch.distributed and the comms logger never records it.

**Why the first call of each call site.** Whether a call is checked must be decided the same way
on every rank without talking, or one rank's check would meet a peer's real collective. The
call site (the caller's code object and bytecode offset) qualifies: ranks running the same
program reach the same sites in the same order, and a site issues the same kind of call each
time. Mismatches are mostly in code, so they show on a site's first call; one that appears only
later at a site that was already checked (data-dependent shapes) is caught only in mode `all`.
Without a check a mismatched call ends in whatever the backend does: a `CommTimeoutError` when
a peer never joins, a `CommBackendError` when gloo aborts, or a wrong result.

**Errors reach every rank.** A rank whose local checks reject its arguments on a checked call
still takes part in the fingerprint exchange, with status 1, before raising; its peers then
raise too instead of blocking in a collective that will never be joined. Point-to-point calls
are not checked (there is no group-wide call to compare).
"""

from __future__ import annotations

import contextlib
import os
import sys
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from minispeed.comm import validation
from minispeed.comm.handoff import Loan, lend
from minispeed.comm.validation import VALIDATE_ENV, CommInputError

__all__ = [
    "ALL",
    "FIRST",
    "OFF",
    "VALIDATE_ENV",
    "checked",
    "compare",
    "reject",
    "validation_enabled",
    "validation_level",
    "validation_mode",
]

OFF, FIRST, ALL = 0, 1, 2
_WORDS = {
    **dict.fromkeys(("0", "off", "false", "no"), OFF),
    **dict.fromkeys(("", "first"), FIRST),
    **dict.fromkeys(("1", "all", "true", "yes", "on"), ALL),
}

# Set by the context manager; None defers to the environment variable, read once per default
# process group (a process may outlive several, e.g. a reused test worker). See Note [logger off
# is one global read] for why the hot path stays this thin.
_LEVEL: int | None = None
_ENV_CACHE: tuple[Any, int] = (None, FIRST)  # (default group it was read under, level)
# (call site, group) -> calls issued there (the first is checked in mode FIRST); reset with the
# world. The group is part of the key: a site that loops over groups meets each group's members
# on their first call to that group.
_SITES: dict[tuple[Any, int, Any], int] = {}


def validation_level() -> int:
    """`OFF`, `FIRST` or `ALL`: the context's mode, else the environment's (default `FIRST`)."""
    global _ENV_CACHE
    world = dist.group.WORLD
    if _ENV_CACHE[0] is not world:
        word = os.environ.get(VALIDATE_ENV, "").strip().lower()
        if word not in _WORDS:
            raise CommInputError(
                f"{VALIDATE_ENV}={word!r} is not a validation mode; use 0 (off), first (the "
                "default) or 1 (every call)"
            )
        _ENV_CACHE = (world, _WORDS[word])
        _SITES.clear()  # a new world: every site starts unchecked on every rank alike
    return _ENV_CACHE[1] if _LEVEL is None else _LEVEL


def validation_enabled() -> bool:
    """Whether every collective is checked across ranks (mode `all`)."""
    return validation_level() == ALL


@contextlib.contextmanager
def validation_mode(enabled: bool | str = True) -> Iterator[None]:
    """Check every call (`True` or `"all"`), the first of each call site (`"first"`) or none
    (`False` or `"off"`) inside the block, overriding the environment.

    Every rank of the group must enter it around the same calls.
    """
    global _LEVEL
    level = {True: ALL, False: OFF}.get(enabled) if isinstance(enabled, bool) else None
    if level is None:
        level = _WORDS.get(str(enabled).strip().lower())
        if level is None or str(enabled).strip() == "":
            raise CommInputError(
                f"validation_mode({enabled!r}): pass True / 'all', 'first' or False / 'off'"
            )
    old, _LEVEL = _LEVEL, level
    try:
        yield
    finally:
        _LEVEL = old


def checked(group: Any, depth: int = 2) -> bool:
    """Whether this call is compared across ranks; call it from the collective itself.

    `depth` is how many frames up the call site is: 2 = the caller of the function that calls
    `checked` (the user's line calling `comm.all_reduce`).
    """
    level = validation_level()
    if level != FIRST:
        return level == ALL
    frame = sys._getframe(depth)
    site = (frame.f_code, frame.f_lasti, group)
    count = _SITES.get(site, 0)
    _SITES[site] = count + 1
    return count == 0


def compare(
    op: str,
    group: Any,
    signature: dict[str, Any],
    error: BaseException | None = None,
    payload: Any = None,
    check_payload: Callable[[str, list[int], list[Any]], None] | None = None,
) -> None:
    """Exchange fingerprints of `(op, signature)` and this rank's status; raise on every rank
    when they differ or a rank rejected its arguments (`error` on that rank).

    `payload` (compared by `check_payload`, e.g. all-to-all split sizes that must mirror each
    other) always takes the slow path: one object all-gather.
    """
    sig = tuple(sorted(signature.items()))
    if payload is None:
        status = 0 if error is None else 1
        mine = torch.tensor(
            [status, zlib.crc32(repr((op, sig)).encode())],
            dtype=torch.int64,
            device=validation.tensor_device(group),
        )
        n = dist.get_world_size(group)
        table = torch.empty(2 * n, dtype=torch.int64, device=mine.device)
        loan = Loan()  # Note [the backend lets go before we do] in handoff.py
        try:  # the list form: every backend has it (a 16-byte exchange needs no fast path)
            with loan:
                dist.all_gather([lend(row) for row in table.view(n, 2)], lend(mine), group=group)
        except RuntimeError as err:  # a peer that never comes: name the call it was waiting for
            loan.settle(block=False)
            raise validation.named_backend_error(err, op, group, signature) from err
        loan.settle()
        rows = table.view(n, 2).cpu()
        if bool((rows[:, 0] == 0).all()) and bool((rows[:, 1] == rows[0, 1]).all()):
            return
    # The slow path: every rank got here together (same table), so the object exchange matches.
    validation.compare_in_full(op, group, sig, error, payload, check_payload)


# Note [errors reach every rank]
# A rank that rejects its own arguments must not simply raise: its peers would wait in the real
# collective until the group's timeout (minutes). On a checked call it first takes part in the
# fingerprint exchange with status 1, so the peers raise at once, quoting its error. Calls that
# are not checked cannot do this without an exchange per call; there the collectives that can
# fail on data (top-k's NaN) send a marked message of the agreed size instead (Note [a rank that
# cannot compress still sends] in compressed_allreduce.py).


def reject(op: str, group: Any, error: Exception, is_checked: bool) -> Exception:
    """`error`, found by this rank's local checks; on a checked call the peers learn of it
    first (they raise `CommInputError` quoting it). Returns the error for the caller to raise."""
    if is_checked:
        compare(op, group, {}, error=error)  # returns on this rank; its peers raise
    return error
