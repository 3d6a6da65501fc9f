"""Bad input to a collective: found on the calling rank before any rank blocks, or named when found.

Three layers, cheapest first:

1. **Local checks** (always on): wrong device for the group's backend, sparse or non-contiguous
   buffers, dtype differing between input and output, output size not matching `n · input` (or
   the reverse for reduce-scatter), a size not divisible by the group size, a rank calling on a
   group it is not a member of. Each raises `CommInputError` on the calling rank before it
   reaches the backend.
2. **Cross-rank checks** (`minispeed.comm.handshake`): by default the first call of each call
   site, or every call in validation mode, compares a 16-byte fingerprint of the call across
   the group; when ranks disagree every rank raises `CommMismatchError` naming the op and the
   ranks that differ, and a rank whose local checks failed tells its peers, which raise too.
3. **Backend errors**: a call that was not checked and does not match its peers ends in what the
   backend does: `CommTimeoutError` (naming the op, the shapes and the group) when a peer never
   joins, `CommBackendError` when the backend aborts, or, for calls whose sizes happen to fit, a
   wrong result. Validation mode (`MINISPEED_COMM_VALIDATE=1`) checks every call.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "VALIDATE_ENV",
    "CommBackendError",
    "CommError",
    "CommInputError",
    "CommMismatchError",
    "CommTimeoutError",
    "first_backend_error",
]

VALIDATE_ENV = "MINISPEED_COMM_VALIDATE"


class CommError(RuntimeError):
    """Base class of every error raised by minispeed.comm."""


class CommInputError(CommError, ValueError):
    """Bad arguments found on the calling rank, before any communication."""


class CommMismatchError(CommError):
    """Ranks of one group called a collective with different ops, shapes or dtypes (validation mode)."""


class CommTimeoutError(CommError):
    """The backend timed out waiting for peers; the message names the op, shapes and group."""


class CommBackendError(CommError):
    """Any other backend failure, re-raised with the op, shapes and group."""


# -- local checks -------------------------------------------------------------------------------
def group_ranks(group: Any) -> list[int]:
    """Global ranks of `group` (the world for `None`); `[]` when unknown to this rank."""
    if group is None:
        return list(range(dist.get_world_size()))
    try:
        return dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return []


def check_group(op: str, group: Any) -> int:
    """Size of `group`; raises when torch.distributed is off or this rank is not a member.

    torch returns silently (with a warning) when a non-member calls a collective, leaving the
    caller's buffers untouched: a silent wrong answer that we turn into an error.
    """
    return group_facts(op, group).n


# Note [a group's facts, once]
# Every collective needs a few facts about its group: its size (which also says whether this
# rank is a member), its rank in it, its global ranks and what devices its backend moves. Each
# is a torch.distributed call of one to two microseconds (`dist.get_world_size` alone makes six
# Python calls), which on a small message is a fifth of the collective. A group's facts cannot
# change while it exists, so they are learned on its first call and kept in `_FACTS`, keyed by
# the group object's id and checked against a weak reference to it (a group freed and another
# made at the same address is learned anew; the cache keeps no group alive). The world is the
# exception: `None` means whatever default group exists now, and a process may destroy it and
# make another (a reused test worker does), so every lookup reads `dist.group.WORLD` (two
# attribute reads) and the cache starts over when it is another object. A non-member group is
# never cached: its error is raised on every call, as before.


class GroupFacts:
    """What every call on one process group needs to know about it (Note [a group's facts,
    once]): `n` its size, `rank` this process's rank in it, `ranks` its global ranks (group rank
    order), `me` this process's global rank, `devices` the device types its backend moves,
    `backend` the backend's name."""

    __slots__ = ("backend", "devices", "me", "n", "rank", "ranks", "ref")

    def __init__(self, group: Any, n: int) -> None:
        self.n = n
        self.rank = dist.get_rank(group)
        self.ranks = (
            tuple(range(n)) if group is None else tuple(dist.get_process_group_ranks(group))
        )
        self.me = self.ranks[self.rank]
        self.backend = str(dist.get_backend(group))
        lowered = self.backend.lower()
        found = []
        if "gloo" in lowered or "mpi" in lowered:
            found.append("cpu")
        if "nccl" in lowered:
            found.append("cuda")
        self.devices: tuple[str, ...] = tuple(found) or ("cpu", "cuda")
        self.ref = None if group is None else weakref.ref(group)


_FACTS: dict[int | None, GroupFacts] = {}  # id(group), None for the world -> its facts
_FACTS_WORLD: list[Any] = [None]  # the default group they were learned under


def group_facts(op: str, group: Any) -> GroupFacts:
    """The facts of `group` (the world for `None`), learned on its first call; raises as
    `check_group` describes when torch.distributed is off or this rank is not a member."""
    world = dist.group.WORLD
    if world is not _FACTS_WORLD[0] or world is None:
        if world is None:
            raise CommInputError(
                f"{op}: torch.distributed is not initialized; call comm.init_distributed() "
                "first (or launch with torchrun)"
            )
        _FACTS.clear()  # a new world: groups of the old one are gone with it
        _FACTS_WORLD[0] = world
    if group is None:
        facts = _FACTS.get(None)
        if facts is not None:
            return facts
    else:
        facts = _FACTS.get(id(group))
        if facts is not None and facts.ref() is group:
            return facts
    n = dist.get_world_size(group)
    if n < 1:
        raise CommInputError(
            f"{op}: global rank {dist.get_rank()} is not a member of this group; only ranks in "
            "the group may call collectives on it (check the ranks passed to comm.new_group, or "
            "guard the call with comm.is_member(group))"
        )
    facts = _FACTS[None if group is None else id(group)] = GroupFacts(group, n)
    return facts


def backend_devices(group: Any) -> tuple[str, ...]:
    """Device types the group's backend moves (`("cpu",)` for gloo), looked up once per group."""
    return group_facts("backend_devices", group).devices


def tensor_device(group: Any = None) -> torch.device:
    """Where a tensor must live to travel over `group`: the host when the group's backend moves
    host tensors (gloo), else the accelerator (NCCL moves only GPU tensors).

    For small bookkeeping tensors a caller builds to communicate (flags, norms, fingerprints):
    they follow the backend, not the data they describe, which offload may keep on the host
    while NCCL carries the collectives.
    """
    if "cpu" in backend_devices(group):
        return torch.device("cpu")
    from minispeed.core.accelerator import get_accelerator

    return get_accelerator().device()


def check_tensors(op: str, group: Any, *tensors: torch.Tensor, contiguous: bool = True) -> None:
    """Each tensor is a dense Tensor on a device the group's backend can move, and contiguous."""
    check_tensor_list(op, group_facts(op, group), tensors, contiguous)


def check_tensor_list(
    op: str, facts: GroupFacts, tensors: Sequence[torch.Tensor], contiguous: bool = True
) -> None:
    """`check_tensors` for a group whose facts the caller holds (`Call.check_tensors`)."""
    allowed = facts.devices
    first: torch.device | None = None
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise CommInputError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
        device = t.device
        if device.type not in allowed:
            backend = facts.backend
            fix = "move it with .cpu()" if allowed == ("cpu",) else "move it to the GPU"
            raise CommInputError(
                f"{op}: tensor of shape {tuple(t.shape)} is on {t.device}, but the group's backend "
                f"{backend!r} moves {'/'.join(allowed)} tensors; {fix} or use a group of the "
                "matching backend"
            )
        if t.layout is not torch.strided:
            raise CommInputError(
                f"{op}: tensor of shape {tuple(t.shape)} is sparse ({t.layout}); collectives move "
                "dense tensors: pass t.to_dense(), or send its indices and values as two dense "
                "tensors"
            )
        if first is None:
            first = device
        elif device != first:
            raise CommInputError(
                f"{op}: tensors are on different devices ({first} and {t.device}); put input and "
                "output on the same device"
            )
        if contiguous and not t.is_contiguous():
            raise CommInputError(
                f"{op}: tensor of shape {tuple(t.shape)} is not contiguous; pass t.contiguous()"
            )


def check_same_dtype(op: str, output: torch.Tensor, input: torch.Tensor) -> None:
    """Input and output share a dtype (the backend would reinterpret bytes otherwise)."""
    if output.dtype != input.dtype:
        raise CommInputError(
            f"{op}: output dtype {output.dtype} differs from input dtype {input.dtype}; "
            "allocate the output with dtype=input.dtype"
        )


def check_one_dtype(
    op: str, what: str, tensors: Sequence[torch.Tensor], dtype: torch.dtype, ref: str
) -> None:
    """Every tensor of `tensors` (named `what[i]`) has `dtype`, that of `ref` (for the message)."""
    for i, t in enumerate(tensors):
        if t.dtype != dtype:
            raise CommInputError(
                f"{op}: {what}[{i}] has dtype {t.dtype}, {ref} {dtype}; coalesce tensors of one "
                "dtype per call"
            )


def check_numel(op: str, what: str, actual: int, expected: int, fix: str) -> None:
    """`actual == expected` or an error naming both and the fix."""
    if actual != expected:
        raise CommInputError(f"{op}: {what} has {actual} elements, expected {expected}; {fix}")


def check_divisible(op: str, numel: int, n: int) -> None:
    """`numel` splits evenly over `n` ranks."""
    if numel % n != 0:
        raise CommInputError(
            f"{op}: {numel} elements do not split evenly over {n} ranks; pad the input to a "
            f"multiple of {n} (next one: {-(-numel // n) * n})"
        )


def check_splits(op: str, what: str, splits: Sequence[int] | None, dim0: int, n: int) -> None:
    """Uneven all-to-all splits: `n` non-negative sizes summing to the tensor's first dimension."""
    if splits is None:
        if dim0 % n != 0:
            raise CommInputError(
                f"{op}: {what} has first dimension {dim0}, not divisible by {n} ranks; pass "
                f"{what}_split_sizes or pad to a multiple of {n}"
            )
        return
    if len(splits) != n or any(int(s) < 0 for s in splits):
        raise CommInputError(
            f"{op}: {what}_split_sizes={list(splits)} must hold {n} non-negative sizes, one per rank"
        )
    if sum(int(s) for s in splits) != dim0:
        raise CommInputError(
            f"{op}: {what}_split_sizes={list(splits)} sums to {sum(splits)} but the {what} has "
            f"first dimension {dim0}; make them agree"
        )


def check_peer(op: str, peer: int, name: str, group: Any) -> None:
    """`peer` is a global rank in `group` (and not this rank for point-to-point)."""
    facts = group_facts(op, group)
    ranks = list(facts.ranks)
    if peer not in ranks:
        raise CommInputError(
            f"{op}: {name}={peer} is not a global rank of the group (ranks {ranks}); pass a global "
            "rank that belongs to the group"
        )
    if op in ("send", "recv", "isend", "irecv") and peer == facts.me:
        raise CommInputError(f"{op}: {name}={peer} is this rank; a rank cannot message itself")


# -- cross-rank validation ----------------------------------------------------------------------
def mismatch_error(gathered: list[tuple[str, Any]], ranks: list[int]) -> CommMismatchError:
    """The error every rank raises when the `(op, signature)` pairs gathered from `ranks`
    differ: it names the minority, the reference rank and every rank's call."""
    values = [repr(g) for g in gathered]
    majority = max(values, key=values.count)  # ties: the lowest rank's call is the reference
    odd = [ranks[i] for i, v in enumerate(values) if v != majority]
    ref = ranks[values.index(majority)]
    lines = "\n".join(
        f"  rank {ranks[i]}: {g[0]}({_describe(g[1])})" for i, g in enumerate(gathered)
    )
    ref_op = gathered[values.index(majority)][0]
    what = (
        "called other collectives or arguments than"
        if any(g[0] != ref_op for g in gathered)
        else "called with arguments that differ from"
    )
    return CommMismatchError(
        f"{ref_op}: ranks {odd} {what} rank {ref} (group ranks {ranks}):\n{lines}\n"
        "Every rank of a group must issue the same collectives in the same order with the same "
        "shapes and dtypes."
    )


def check_all_to_all_splits(op: str, ranks: list[int], payloads: list[Any]) -> None:
    """Rank i's `output_split_sizes[j]` must equal rank j's `input_split_sizes[i]`."""
    bad, involved = [], set()
    for i, (_, out_i) in enumerate(payloads):
        for j, (in_j, _) in enumerate(payloads):
            if out_i[j] != in_j[i]:
                involved.update((ranks[i], ranks[j]))
                bad.append(
                    f"  rank {ranks[i]} expects {out_i[j]} rows from rank {ranks[j]}, "
                    f"which sends it {in_j[i]}"
                )
    if bad:
        raise CommMismatchError(
            f"{op}: split sizes disagree between ranks {sorted(involved)}:\n"
            + "\n".join(bad)
            + "\nEach rank's output_split_sizes must mirror its peers' input_split_sizes."
        )


def _describe(signature: Any) -> str:
    return (
        " ".join(f"{k}={v}" for k, v in signature)
        if isinstance(signature, tuple)
        else str(signature)
    )


# -- backend errors -----------------------------------------------------------------------------
_TIMEOUT_RE = re.compile(r"timed? ?out|timeout|pair closure", re.IGNORECASE)
# gloo's words when the process at the other end of a connection is gone
_PEER_LOST_RE = re.compile(r"(closed|reset) by peer|broken pipe|connection refused", re.IGNORECASE)

# Note [a failed collective breaks the group]
# After the backend failed a collective (a timeout, a peer that closed its connection) the
# process cannot count on its peers again: gloo's connection to a dead peer stays closed, and
# ranks that timed out are out of step. `wrap_backend_error` keeps the message of the first
# such error of the process (`first_backend_error`), so code that waits for the other ranks
# outside any collective (the background checkpoint writer waiting for their done markers at
# exit) knows at once that they are not coming, instead of waiting out its own bound. The text
# only: the error itself would keep its traceback's frames, and with them the call's tensors
# and loans, alive for the rest of the process.
_first_backend_error: str | None = None


def first_backend_error() -> str | None:
    """The message of the first collective the backend failed in this process (None while all
    went well): see Note [a failed collective breaks the group]."""
    return _first_backend_error


def wrap_backend_error(
    err: BaseException, op: str, group: Any, shapes: Sequence[Any], dtype: Any
) -> CommError:
    """A `CommTimeoutError` (or `CommBackendError`) naming op, shapes and group; a lost peer is
    named as such (the other rank itself when the group has two). Recorded for
    `first_backend_error`."""
    global _first_backend_error
    ranks = group_ranks(group)
    me = dist.get_rank()
    where = f"{op} on rank {me} over group ranks {ranks} (shapes {list(shapes)}, dtype {dtype})"
    if _TIMEOUT_RE.search(str(err)):
        wrapped: CommError = CommTimeoutError(
            f"{where} timed out: a peer probably did not call {op}, or called it with other "
            f"arguments or in another order. Rerun with {VALIDATE_ENV}=1 to compare calls across "
            f"ranks. Backend said: {err}"
        )
    elif _PEER_LOST_RE.search(str(err)):
        others = [r for r in ranks if r != me]
        who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
        wrapped = CommBackendError(
            f"{where} failed: {who} closed its connection, so that process exited or was killed "
            f"while this rank waited in {op}. Its own log holds the cause; this rank cannot go "
            f"on (restart the job, from its last checkpoint). Backend said: {err}"
        )
    else:
        wrapped = CommBackendError(f"{where} failed: {err}")
    if _first_backend_error is None:
        _first_backend_error = str(wrapped)
    return wrapped


# -- the cross-rank check's slow path (handshake.compare: fingerprints differ) --------------------
def compare_in_full(
    op: str,
    group: Any,
    sig: tuple,
    error: BaseException | None = None,
    payload: Any = None,
    check_payload: Callable[[str, list[int], list[Any]], None] | None = None,
) -> None:
    """The slow path: all-gather every rank's `(op, signature, payload, error text)` as pickled
    objects and raise the same error on every rank (or return when all agree).

    Costs a length all-gather, a payload all-gather and n unpicklings; before the fingerprint,
    validation mode paid this on every call.
    """
    n = dist.get_world_size(group)
    everything: list[Any] = [None] * n
    text = None if error is None else f"{type(error).__name__}: {error}"
    try:
        dist.all_gather_object(everything, (op, sig, payload, text), group=group)
    except RuntimeError as err:
        raise named_backend_error(err, op, group, dict(sig)) from err
    ranks = group_ranks(group)
    failed = [(ranks[i], g[3]) for i, g in enumerate(everything) if g[3] is not None]
    if failed:
        if error is not None:
            return  # the caller raises its own error
        lines = "\n".join(f"  rank {r}: {t}" for r, t in failed)
        raise CommInputError(
            f"{op}: rank(s) {[r for r, _ in failed]} rejected their arguments, so no rank of "
            f"group {ranks} runs this call:\n{lines}\nFix the input on those ranks."
        )
    gathered = [(g[0], g[1]) for g in everything]
    if all(g == gathered[0] for g in gathered):
        if check_payload is not None:
            check_payload(op, ranks, [g[2] for g in everything])
        return
    raise mismatch_error(gathered, ranks)


def named_backend_error(
    err: BaseException, op: str, group: Any, signature: dict[str, Any]
) -> Exception:
    """`err` from the backend during a cross-rank check, naming the call it was checking."""
    shapes = [signature["shape"]] if "shape" in signature else signature.get("shapes", [])
    return wrap_backend_error(err, op, group, shapes, signature.get("dtype"))
