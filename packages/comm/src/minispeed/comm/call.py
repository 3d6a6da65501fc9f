"""One collective call on its way to torch.distributed: every collective goes through `Call`.

A public collective (`collectives.py`, `compression/`) reads as four steps, each a line or a
block here:

```python
call = Call("all_gather", group)        # group check; decides whether ranks compare this call
with call:                               # local checks: an error here reaches the peers first
    validation.check_tensors(...)
call.agree(lambda: {"shape": ..., "dtype": ...})   # the cross-rank check, when decided
return call.launch(issue, async_op, ...)           # range, timing, ledger record, named errors
```

`issue` is the backend call itself: `dist.all_reduce(...)`, or one of the flat collectives at
the bottom of this file (`all_gather_flat`, `reduce_scatter_flat`, `native_or_fallback`), which
pick torch's name for the op (Note [flat collective names across torch versions]) and switch to
a fallback when the backend lacks it (`api_compat`, read only for such a backend).

Cost when no logger is active and the call is not cross-checked: one dict lookup for the
group's facts (size, rank, ranks, backend: Note [a group's facts, once] in validation.py), one
for the call site (see `handshake.checked`), one range, one loan, a handful of slot writes; a
synchronous call makes no `CommWork`.
23 Python calls in minispeed for a synchronous all-reduce (29 before the facts were kept; torch's
own `dist.all_reduce` makes 11), counted by `tests/test_call_overhead.py`. A cross-checked call
adds one all-gather of 16 bytes per rank (`handshake.compare`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from minispeed.comm import api_compat, costs, handshake, logger, ring, validation
from minispeed.comm.api_compat import Issued
from minispeed.comm.handoff import Loan, lend
from minispeed.comm.validation import CommInputError
from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator

__all__ = [
    "Call",
    "CommWork",
    "Issued",
    "all_gather_flat",
    "native_or_fallback",
    "reduce_scatter_flat",
]


class Call:
    """One collective call: its checks, its cross-rank check, its launch and its log record.

    Made first thing in a collective (it checks the group and decides, from the caller's call
    site, whether ranks compare this call); `with call:` around the local checks turns an error
    of a `rejects` type into one the peers learn of first (Note [errors reach every rank] in
    handshake.py); `agree` compares the call across ranks when decided; `launch` issues it. The
    call, kept by its `CommWork`, holds shapes only, never a buffer.
    """

    __slots__ = ("caller", "checked", "compat_op", "dtype", "facts", "group", "impl", "msg_bytes")
    __slots__ += ("n", "numel", "op", "rejects", "shapes", "step", "wire")

    def __init__(
        self,
        op: str,
        group: Any,
        *,
        rejects: tuple[type[Exception], ...] = (CommInputError,),
        cross_check: bool = True,
        ledger_group_size: int | None = None,
    ) -> None:
        self.op, self.group, self.rejects = op, group, rejects
        # the group check, and the group's size, rank, ranks and backend, known after its first
        # call (Note [a group's facts, once] in validation.py)
        self.facts = facts = validation.group_facts(op, group)
        # the group size of the record: a point-to-point message has two ends, whatever the group
        self.n = facts.n if ledger_group_size is None else ledger_group_size
        # depth 3: checked <- Call.__init__ <- the collective <- its caller, the call site
        self.checked = cross_check and handshake.checked(group, depth=3)
        self.impl = "native"  # or the fallback that ran, known at launch
        # compat_op, dtype, msg_bytes, numel, shapes, wire: set by launch, which describes the
        # message; step (and caller, when asked for): the logger's step at issue, when a logger
        # records this call
        self.step: int | None = None
        self.caller = ""

    def __enter__(self) -> Call:
        return self

    def __exit__(self, kind: Any, err: BaseException | None, tb: Any) -> bool:
        if err is not None and isinstance(err, self.rejects):
            handshake.reject(self.op, self.group, err, self.checked)  # its peers raise too
        return False  # the error goes on to the caller

    def agree(
        self,
        signature: Callable[[], dict[str, Any]],
        payload: Callable[[], Any] | None = None,
        check_payload: Callable[[str, list[int], list[Any]], None] | None = None,
    ) -> None:
        """On a cross-checked call, compare `signature()` (what must agree: shape, dtype, reduce
        op, root) across the group; every rank raises when they differ. `payload()`, checked by
        `check_payload` (all-to-all's mirrored split sizes), takes an object all-gather, so it
        is compared in validation mode `all` only. Built lazily: an unchecked call pays nothing.
        """
        if not self.checked:
            return
        if payload is not None and handshake.validation_enabled():
            handshake.compare(
                self.op, self.group, signature(), payload=payload(), check_payload=check_payload
            )
        else:
            handshake.compare(self.op, self.group, signature())

    def launch(
        self,
        issue: Callable[[], Issued | Any],
        async_op: bool,
        t: torch.Tensor | None,
        msg_numel: int,
        tensors: Sequence[torch.Tensor],
        *,
        compat_op: str | None = None,
        wire: int | None = None,
        msg_bytes: int | None = None,
    ) -> CommWork | None:
        """Run `issue` (the backend call) inside the range `comm.<op>`, timed and logged when a
        logger is active; backend errors come back naming this call.

        `t` and `msg_numel` give the message of the ledger (`msg_numel` elements of `t`'s
        dtype, unless `msg_bytes` says otherwise); `tensors` are every buffer, for an error
        message. `wire`: bytes sent, when not the ring formula of `costs.wire_bytes`.
        `compat_op`: the flat op whose fallback, if the backend lacks it, the record names.
        The range covers the issue (the whole call when synchronous); with no profiler or NVTX
        tool listening it costs a few attribute reads (see `minispeed.core.ranges`).

        A synchronous call completes here without a `CommWork`: the same steps as
        `CommWork.wait` (`complete`), minus the backend's wait, which the backend did.
        """
        log = logger._ACTIVE  # See Note [logger off is one global read]
        if log is not None and log.ops is not None and self.op not in log.ops:
            log = None  # an op the logger does not record runs as with none (prof_ops)
        self.numel, self.compat_op, self.wire = msg_numel, compat_op, wire
        self.dtype = t.dtype if t is not None else None
        if msg_bytes is None:
            msg_bytes = msg_numel * (t.element_size() if t is not None else 0)
        self.msg_bytes = msg_bytes
        self.shapes = [tuple(x.shape) for x in tensors]  # kept by the handle: never a buffer
        t0 = 0.0
        if log is not None:
            self.step = log.step  # the step of issue, also for an async call logged at wait()
            if log.callers:  # launch <- the collective <- ... <- the first frame outside comm
                self.caller = logger.caller_name(skip=1)
            get_accelerator().synchronize()
            t0 = time.perf_counter()
        # `issue` hands the backend `lend(t)`: Note [the backend lets go before we do]
        loan = Loan()
        try:
            name = _RANGE_NAMES.get(self.op) or _RANGE_NAMES.setdefault(self.op, f"comm.{self.op}")
            with loan, ranges.range(name):
                issued = issue()
        except RuntimeError as err:
            loan.settle(block=False)  # a failed op: the backend may hold them until torn down
            if isinstance(err, validation.CommError):
                raise
            raise self.error(err) from err
        work, finish = issued if isinstance(issued, tuple) else (issued, None)
        if compat_op is not None and self.impl == "native":  # unless the op chose it already
            self.impl = api_compat.impl_of(compat_op, self.group)
        if async_op:
            return CommWork(work, self, finish, log, t0, loan)
        if finish is not None:  # the op has finished (recv's return value is a rank, not a Work)
            finish()
        self.complete(loan, log, t0, False)  # and returns None

    def complete(self, loan: Loan | None, log: Any, t0: float, async_op: bool) -> None:
        """Once the op completed and its results are out: settle the loan (the backend let go of
        the op's tensors), then append the record when `log` is set."""
        if loan is not None:
            loan.settle()
        if log is not None:
            get_accelerator().synchronize()
            self.record(log, time.perf_counter() - t0, async_op=async_op)

    def wire_bytes(self) -> int:
        """Bytes this rank sent: given explicitly, or the ring formula of the implementation used."""
        if self.wire is not None:
            return self.wire
        return costs.wire_bytes(self.op, self.msg_bytes, self.n, impl=self.impl)

    def record(self, log: Any, latency_s: float, async_op: bool = False) -> None:
        """Append this call to `log`."""
        log.add(
            self.op,
            self.numel,
            str(self.dtype),
            self.msg_bytes,
            self.n,
            latency_s,
            self.wire_bytes(),
            async_op=async_op,
            step=self.step,
            impl=self.impl,
            ranks=self.facts.ranks,
            caller=self.caller,
        )

    def error(self, err: BaseException) -> validation.CommError:
        """`err` from the backend, re-raised as an error that names this call."""
        return validation.wrap_backend_error(err, self.op, self.group, self.shapes, self.dtype)


class CommWork:
    """Handle of an async collective: `wait()` finishes it, copies results out, logs its latency.

    Wraps the backend's Work. Coalesced and fallback ops finish their output copies in `wait()`,
    so read outputs only after it returns; once it has, the backend holds none of the op's
    tensors (Note [the backend lets go before we do] in handoff.py). Waiting twice is harmless.
    """

    __slots__ = ("_call", "_done", "_finish", "_loan", "_log", "_t0", "_work")

    def __init__(
        self,
        work: Any,
        call: Call,
        finish: Callable[[], None] | None,
        log: Any,
        t0: float,
        loan: Loan,
    ) -> None:
        self._work, self._call, self._finish, self._log, self._t0 = work, call, finish, log, t0
        self._loan, self._done = loan, False  # the loan: None once settled or given up

    def wait(self) -> bool:
        """Block until the op completed (on a GPU: until the current stream is ordered after it)."""
        if self._done:
            return True
        try:
            if self._work is not None:
                self._work.wait()
        except RuntimeError as err:
            if self._loan is not None:  # a failed op: the backend may hold them until torn down
                self._loan.settle(block=False)
                self._loan = None
            raise self._call.error(err) from err
        if self._finish is not None:
            self._finish()
        self._done = True
        # Drop the backend's Work and the finishing step: both reference the op's buffers (a
        # coalesced all-gather's n·Σ temporary), which a handle kept after wait() must not pin;
        # then the loan, once the backend's worker has let go of them too.
        loan = self._loan
        self._work = self._finish = self._loan = None
        self._call.complete(loan, self._log, self._t0, True)
        return True

    def is_completed(self) -> bool:
        """Whether the backend finished (outputs are final only after `wait`)."""
        return self._done or self._work is None or self._work.is_completed()


# op -> "comm.<op>", made once per op so a call builds no string
_RANGE_NAMES: dict[str, str] = {}  # "comm.<op>", made once per op


# -- the flat collectives: torch's name for each, and the switch to a fallback ------------------
# Note [flat collective names across torch versions]
# torch 2.13 renamed the flat ("into one tensor") collectives: `all_gather_into_tensor` became
# `all_gather_single` and `reduce_scatter_tensor` became `reduce_scatter_single`; the old names
# still work but warn. The GPU machines carry torch 2.11, which has only the old names. We pick
# by feature (`hasattr`), never by version string, once at import, so no deprecation warning
# fires on 2.13 and nothing breaks on 2.11. These two lines are the only place that chooses.
ALL_GATHER_FLAT_NATIVE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER_FLAT_NATIVE = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def native_or_fallback(
    op: str, group: Any, native: Callable[[], Any], fallback: Callable[[], Issued]
) -> Issued:
    """Run `native`; if the backend says it lacks the op, remember that and run `fallback`
    (Note [backend fallbacks] in api_compat.py)."""
    if api_compat.impl_of(op, group) != "native":
        return fallback()
    try:
        return native(), None
    except RuntimeError as err:
        if not api_compat.remember_missing(op, group, err):
            raise
        return fallback()


def all_gather_flat(
    outs: list[torch.Tensor], ins: list[torch.Tensor], group: Any, async_op: bool, impl: str
) -> Issued:
    """Gather every rank's `ins[i]` into `outs[i]` (1-D, rank-major, n·m elements).

    `impl`: what `api_compat.all_gather_impl` chose (the caller logs it). `broadcasts` (Note
    [gloo's all-gather is broadcasts] in api_compat.py): chunk j of each output from rank j,
    received in place, this rank's chunk a copy of the input (none when it is that chunk).
    Otherwise the backend's flat all-gather, of one output.
    """
    if impl == "broadcasts":
        facts, works = validation.group_facts("all_gather", group), []
        for output, input in zip(outs, ins):
            chunks = output.view(facts.n, -1).unbind(0)
            if chunks[facts.rank].data_ptr() != input.data_ptr():
                chunks[facts.rank].copy_(input)
            works += [
                dist.broadcast(lend(c), j, group=group, async_op=True)
                for c, j in zip(chunks, facts.ranks)
            ]
        work = api_compat.WorkList(works)
        return work if async_op or not work.wait() else None, None  # wait() is True
    (output,), (input,) = outs, ins  # one
    return native_or_fallback(
        "all_gather",
        group,
        lambda: ALL_GATHER_FLAT_NATIVE(lend(output), lend(input), group=group, async_op=async_op),
        lambda: api_compat.all_gather_list(output, input, group, async_op),
    )


def reduce_scatter_flat(
    output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, async_op: bool, impl: str
) -> Issued:
    """Reduce `input` (n·m elements) over the group; this rank's m-element chunk lands in `output`.

    `impl`: what `api_compat.reduce_scatter_impl` chose for this call (the caller logs it, so it
    is computed once). `ring_p2p`: comm's own ring over point-to-point messages (ring.py). In
    place, where the backend's reduce-scatter is an all-reduce anyway (`all_reduce_in_place`,
    Note [gloo's reduce-scatter is an all-reduce] in api_compat.py), the input itself is
    all-reduced: the same bytes, no buffer, no copy.
    """
    if impl == "ring_p2p":  # Note [ring reduce-scatter over p2p] in ring.py
        return ring.reduce_scatter_ring(output, input, group, async_op)
    if impl == "all_reduce_in_place":
        return dist.all_reduce(lend(input), op=op, group=group, async_op=async_op), None

    def fallback() -> Issued:
        return api_compat.reduce_scatter_by_all_reduce(output, input, op, group, async_op)

    if impl == "all_reduce+slice":
        return fallback()
    return native_or_fallback(
        "reduce_scatter",
        group,
        lambda: REDUCE_SCATTER_FLAT_NATIVE(
            lend(output), lend(input), op=op, group=group, async_op=async_op
        ),
        fallback,
    )
