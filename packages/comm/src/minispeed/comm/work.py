"""How one collective call is issued, timed, logged and waited on (shared by every op).

`launch` is the single choke point: it reads the active comms logger once (see
Note [logger off is one global read]), issues the backend call, turns backend exceptions into
errors that name the op, and wraps async handles in `CommWork`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from minispeed.comm import api_compat, costs, logger, validation
from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator

__all__ = ["Call", "CommWork", "launch"]


class CommWork:
    """Handle of an async collective: `wait()` finishes it, copies results out, logs its latency.

    Wraps the backend's Work. Coalesced and fallback ops finish their output copies in `wait()`,
    so read outputs only after it returns. Waiting twice is harmless.
    """

    __slots__ = ("_call", "_done", "_finish", "_log", "_t0", "_work")

    def __init__(
        self, work: Any, call: Call, finish: Callable[[], None] | None, log: Any, t0: float
    ) -> None:
        self._work, self._call, self._finish, self._log, self._t0 = work, call, finish, log, t0
        self._done = False

    def wait(self) -> bool:
        """Block until the op completed (on a GPU: until the current stream is ordered after it)."""
        if self._done:
            return True
        try:
            if self._work is not None:
                self._work.wait()
        except RuntimeError as err:
            raise self._call.error(err) from err
        if self._finish is not None:
            self._finish()
        self._done = True
        # Drop the backend's Work and the finishing step: both reference the op's buffers (a
        # coalesced all-gather's n·Σ temporary), which a handle kept after wait() must not pin.
        self._work = self._finish = None
        if self._log is not None:
            get_accelerator().synchronize()
            self._call.record(self._log, time.perf_counter() - self._t0, async_op=True)
        return True

    def is_completed(self) -> bool:
        """Whether the backend finished (outputs are final only after `wait`)."""
        return self._done or self._work is None or self._work.is_completed()


class Call:
    """What one call is, for its log record and its error message. Cheap: a handful of slots."""

    __slots__ = (
        "compat_op",
        "dtype",
        "group",
        "impl",
        "msg_bytes",
        "n",
        "numel",
        "op",
        "shapes",
        "step",
        "wire",
    )

    def __init__(
        self,
        op: str,
        group: Any,
        n: int,
        t: torch.Tensor | None,
        msg_numel: int,
        tensors: Sequence[torch.Tensor],
        wire: int | None = None,
        compat_op: str | None = None,
    ) -> None:
        self.op, self.group, self.n, self.impl = op, group, n, "native"
        # the api_compat op this call runs through; its impl is known only after issue (a
        # backend's missing op is discovered on first use). See Note [backend fallbacks].
        self.compat_op = compat_op
        self.numel = msg_numel
        self.dtype = t.dtype if t is not None else None
        self.msg_bytes = msg_numel * (t.element_size() if t is not None else 0)
        # Shapes only, for an error message: a call (kept by its CommWork) never pins a buffer.
        self.shapes = [tuple(t.shape) for t in tensors]
        self.wire = wire
        self.step: int | None = None  # the logger's step at issue, when a logger is active

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
            ranks=tuple(validation.group_ranks(self.group)),
        )

    def error(self, err: BaseException) -> validation.CommError:
        """`err` from the backend, re-raised as an error that names this call."""
        return validation.wrap_backend_error(err, self.op, self.group, self.shapes, self.dtype)


def launch(
    call: Call, issue: Callable[[], api_compat.Issued | Any], async_op: bool
) -> CommWork | None:
    """Issue one backend call inside the range `comm.<op>`, time it when a logger is active, wrap
    its handle and errors.

    The range covers the issue (the whole call when synchronous); with no profiler or NVTX tool
    listening it costs a few attribute reads (see `minispeed.core.ranges`).
    """
    log = logger._ACTIVE
    t0 = 0.0
    if log is not None:
        call.step = log.step  # the step of issue, also for an async call logged at wait()
        get_accelerator().synchronize()
        t0 = time.perf_counter()
    try:
        with ranges.range(_RANGE_NAMES.get(call.op) or _range_name(call.op)):
            issued = issue()
    except RuntimeError as err:
        if isinstance(err, validation.CommError):
            raise
        raise call.error(err) from err
    work, finish = issued if isinstance(issued, tuple) else (issued, None)
    if call.compat_op is not None and call.impl == "native":  # unless the op chose it already
        call.impl = api_compat.impl_of(call.compat_op, call.group)
    if async_op:
        return CommWork(work, call, finish, log, t0)
    if finish is not None:
        finish()
    if log is not None:
        get_accelerator().synchronize()
        call.record(log, time.perf_counter() - t0)
    return None


# op -> "comm.<op>", made once per op so a call builds no string
_RANGE_NAMES: dict[str, str] = {}


def _range_name(op: str) -> str:
    name = _RANGE_NAMES[op] = f"comm.{op}"
    return name
