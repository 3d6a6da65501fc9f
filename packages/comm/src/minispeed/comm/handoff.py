"""Tensors lent to the backend, and their return: a collective returns (or its `wait()` does)
only once the backend has let go of every tensor it was handed.

```python
with Loan() as loan:                       # Call.launch opens one around each backend call
    work = dist.all_reduce(lend(t), async_op=True)
work.wait(); del work
loan.settle()                              # the backend holds nothing of ours from here on
```

Note [the backend lets go before we do]
torch.distributed's gloo backend runs each collective on a worker thread, in a work object that
holds the op's tensors. The thread marks the op complete, which wakes `wait()` (or the
synchronous call) on the caller's thread, and only then drops the work. In a 2-rank loop of
2,000 small all-reduces here, about half of the calls, synchronous or not, returned before the
worker had dropped it (`scripts/stress_exit.py` holds the harness of the failure below). When
the caller has meanwhile dropped its own reference to a tensor, the worker's drop is the last
one, and since torch keeps a tensor's Python object alive while C++ still holds the tensor,
that drop releases a Python object: it takes the GIL. While the interpreter runs that is a GIL
hand-off. Once the interpreter finalizes (a script's last collective, then exit, on a loaded
machine where the worker is scheduled late), a thread taking the GIL is made to exit
(`pthread_exit`), and the unwinding, stopped by torch's `noexcept` tensor destructor, ends in
`terminate called without an active exception`: SIGABRT after a run that trained correctly
(issue 32; a SIGABRT handler's backtrace showed `ProcessGroupGloo::runLoop` ->
`TensorImpl::~TensorImpl` -> `decref_pyobject` -> `PyEval_AcquireThread` -> `pthread_exit`).
Destroying the process group does not stop its worker threads while any object still holds the
group (an engine, an optimizer, a script's global): they live until the group is freed, at
interpreter finalization at the latest.

So each tensor handed to the backend is a private alias (`lend(t)`: `t.detach()`, the same
storage, a tensor object nobody else holds) kept by the call's `Loan`, and a loan is settled
once its op is complete: `settle()` waits, the GIL released, until each alias's C++ use count is
1 (ours alone: the backend has let go), then drops the aliases on this thread. A collective
that returned, or a `wait()` that did, leaves the backend holding nothing of the caller's, so
a buffer is freed when its owner frees it (not when a worker thread gets round to it), and no
worker has a Python object left to release during finalization. Where `wait()` does not mean
the backend is done (a GPU backend, where it only orders streams), the loan waits, unblocking,
among the `unsettled` ones: each later settle drops those returned by then, and
`comm.destroy_process_group` and the exit hook settle them all (`settle_all`).

Cost: one `detach` per tensor handed over (a tensor object, about a microsecond) and one
use-count read per alias; a wait only while the worker thread has not yet let go (Note [waiting
for the worker: yield, not sleep]).

Note [waiting for the worker: yield, not sleep]
The worker's drop comes a few microseconds after it woke the caller, unless it was preempted in
between, which on a loaded machine happens to a fifth to a third of small calls and then lasts
until the scheduler runs it again. The wait used to sleep (10 µs, doubling to 1 ms): on 2 gloo
ranks at load 6-9, a 1,024-element all-reduce plus that wait then took 4-8x the wall time and
3-4x the CPU time of the bare all-reduce (the waits themselves averaged 45 µs: a caller that
had slept made its next calls slow), and comm's small collectives cost 1.3-7x torch's CPU time
(`benchmarks/comm_call_overhead.py`). Yielding the processor instead (`os.sched_yield`, the GIL
released) costs what not waiting at all costs. So the wait yields for up to `YIELD_S`, then
sleeps in growing pauses (a worker that slow is not about to finish, and a loop of yields
would spin on an idle machine).
"""

from __future__ import annotations

import os
import threading
import time

import torch

from minispeed.core.logging import get_logger

__all__ = ["Loan", "lend", "settle_all"]

_log = get_logger("comm")
_local = threading.local()  # .open: the Loan of the backend call running on this thread
_unsettled: list[Loan] = []  # loans the backend may still hold (GPU ops, waits given up on)
SETTLE_TIMEOUT_S = 60.0
"""How long `settle` waits for a worker thread to let go before leaving the loan unsettled
(with a warning): a worker scheduled late takes milliseconds; a minute means something else
holds the backend's work."""
YIELD_S = 2e-3
"""How long `settle` yields the processor to a worker that has not let go yet before it sleeps
(Note [waiting for the worker: yield, not sleep])."""
_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


class Loan:
    """The tensors one backend call was handed (as aliases), until the backend let go of them.

    Entered around the call (`lend` adds to the innermost open loan of this thread); settled
    after the op completed. Holds aliases only: their storage is the caller's.
    """

    __slots__ = ("_outer", "aliases")

    def __init__(self) -> None:
        self.aliases: list[torch.Tensor] = []
        self._outer: Loan | None = None

    def __enter__(self) -> Loan:
        self._outer = getattr(_local, "open", None)
        _local.open = self
        return self

    def __exit__(self, *exc: object) -> bool:
        _local.open, self._outer = self._outer, None
        return False

    def returned(self) -> bool:
        """Whether the backend has let go of every alias (each one's use count is ours alone)."""
        return all(a._use_count() == 1 for a in self.aliases)

    def settle(self, block: bool | None = None) -> None:
        """Drop the aliases once the backend let go of them (Note [the backend lets go before
        we do]). `block=None`: wait when every alias is a CPU tensor (the op is complete when
        its `wait()` returns, so the worker's drop is imminent), else leave the loan unsettled
        for a later settle. Call it only after the op completed."""
        if _unsettled:
            _sweep()
        aliases = self.aliases
        for a in aliases:  # `returned()`, inlined: this runs once per collective
            if a._use_count() != 1:
                break
        else:
            aliases.clear()
            return
        self._wait(block)

    def _wait(self, block: bool | None) -> None:
        """`settle` once the backend has not let go at the first look."""
        if block is None:
            block = all(a.device.type == "cpu" for a in self.aliases)
        if block and _wait_returned(self, SETTLE_TIMEOUT_S):
            self.aliases.clear()
            return
        if block:
            _log.warning(
                "the backend still holds a collective's tensors %.0f s after the op completed; "
                "keeping them until destroy_process_group", SETTLE_TIMEOUT_S,
            )  # fmt: skip
        _unsettled.append(self)


def lend(t: torch.Tensor) -> torch.Tensor:
    """`t` as the backend should be handed it: a private alias (same storage) that the open
    `Loan` keeps until the backend let go of it."""
    loan = getattr(_local, "open", None)
    if loan is None:
        raise RuntimeError("comm.handoff.lend called outside a Loan: open one around the call")
    alias = t.detach()
    loan.aliases.append(alias)
    return alias


def settle_all(timeout_s: float = SETTLE_TIMEOUT_S) -> None:
    """Wait (up to `timeout_s` in all) until the backend let go of every unsettled loan, and drop
    them: before a process group is destroyed and at exit."""
    deadline = time.monotonic() + timeout_s
    while _unsettled:
        loan = _unsettled[-1]
        if not _wait_returned(loan, deadline - time.monotonic()):
            _log.warning("the backend still holds %d collectives' tensors", len(_unsettled))
            return
        _unsettled.pop()


def _sweep() -> None:
    """Drop the unsettled loans the backend has let go of by now (no waiting)."""
    if _unsettled:
        _unsettled[:] = [loan for loan in _unsettled if not loan.returned()]


def _wait_returned(loan: Loan, timeout_s: float) -> bool:
    """Wait until the backend let go of `loan`'s aliases: yield, then sleep (Note [waiting for
    the worker: yield, not sleep]); False after `timeout_s`."""
    now = time.monotonic()
    deadline, yield_until = now + timeout_s, now + min(YIELD_S, timeout_s)
    pause = 1e-5
    while not loan.returned():
        now = time.monotonic()
        if now > deadline:
            return False
        if now < yield_until:
            _yield()  # releases the GIL: the worker may need it for its own drops
        else:
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
    return True
