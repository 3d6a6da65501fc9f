"""The comms logger: one record per collective call, so every byte minispeed sends is accounted for.

Off by default. Every collective in `minispeed.comm.collectives` does one global read
(`_ACTIVE is None`) and nothing else when no logger is active. Turn it on with a context:

```python
with comm.CommsLogger() as log:
    ...                      # collectives run here are recorded
    log.mark_step()          # optional: start step 1 (records carry the step they ran in)
log.summary()                # rich table: per op and message size
log.to_json("comms.json")    # machine-readable; temp file, fsync, rename
```

What one `CommRecord` holds: the op name, element count and dtype of the message, its size
`msg_bytes` (nccl-tests convention, see `minispeed.comm.costs`), the group size, the latency,
the algorithmic bandwidth `algbw = msg_bytes / latency` and bus bandwidth `busbw = algbw · factor`
with the per-op factor of `bus_bandwidth_factor` (all_reduce 2(n-1)/n;
all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, send, recv 1), the bytes this rank
put on the wire (`wire_bytes`), whether the call was async, the step, and `impl` (`"native"`,
or the name of the fallback used where the backend lacks the op: its wire bytes are those of the
fallback).

Latency: the logger synchronizes the accelerator before and after a synchronous call (on the CPU
this costs nothing; on a GPU it removes overlap while logging is on, which is the price of exact
timings). An async call is timed from issue to the return of its handle's `wait()`, so its
latency includes any compute it overlapped with: an upper bound on the transfer time.
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, ClassVar

from minispeed.comm import costs
from minispeed.core.files import atomic_write_json
from minispeed.core.sections import Section, key

__all__ = ["CommRecord", "CommsLogger", "CommsLoggerConfig", "comms_logger"]

# The one global the hot path reads. See Note [logger off is one global read].
_ACTIVE: CommsLogger | None = None

# Note [logger off is one global read]
# Collectives sit on the critical path of every training step. With logging off, each call pays
# a single module-global load and an `is None` test; nothing is allocated, no clock is read and
# the accelerator is never synchronized.


@dataclass(frozen=True)
class CommsLoggerConfig(Section):
    """The comms logger in an engine (DeepSpeed section `comms_logger`): `enabled` records every
    collective of the run into the engine's `CommsLogger`. DeepSpeed's printing options are
    accepted so its configs load; the log itself always holds every call (read it, or its
    `summary()`)."""

    ds_path: ClassVar[str] = "comms_logger"

    enabled: bool = key("enabled", False)
    """Record every collective into `engine.comms_logger`."""
    verbose: bool = key("verbose", False)
    """DeepSpeed's: print each collective as it runs. Accepted; minispeed prints nothing per
    call."""
    prof_all: bool = key("prof_all", True)
    """DeepSpeed's: profile every collective. Accepted; minispeed always records every call."""
    prof_ops: list[str] = key("prof_ops", default_factory=list)
    """DeepSpeed's: the collectives to profile when `prof_all` is false. Accepted; minispeed
    records every call whatever it lists."""
    debug: bool = key("debug", False)
    """DeepSpeed's: name each collective's caller. Accepted; minispeed's records carry no
    caller."""


@dataclass(frozen=True)
class CommRecord:
    """One collective call as this rank saw it."""

    op: str
    """Op name, one of `minispeed.comm.costs.OPS`."""
    numel: int
    """Elements in the message (the tensor whose bytes are `msg_bytes`)."""
    dtype: str
    """Element type, e.g. `"torch.float32"`."""
    msg_bytes: int
    """Message size S by the nccl-tests convention (gathered bytes for all_gather, input for reduce_scatter)."""
    group_size: int
    """Ranks in the group the call ran on."""
    latency_s: float
    """Seconds from issue to completion (to `wait()` for async calls)."""
    algbw: float
    """Algorithmic bandwidth, bytes per second: `msg_bytes / latency_s`."""
    busbw: float
    """Bus bandwidth, bytes per second: `algbw · bus_bandwidth_factor(op, group_size)`."""
    wire_bytes: int
    """Bytes this rank sent (see `minispeed.comm.costs.wire_bytes`, or the fallback's cost)."""
    async_op: bool = False
    """Whether the call returned a handle."""
    step: int = 0
    """Value of the logger's step counter when the call was issued (see `CommsLogger.mark_step`)."""
    impl: str = "native"
    """`"native"`, or the fallback that replaced an op the backend lacks (e.g. `"all_reduce+slice"`)."""
    ranks: tuple[int, ...] = ()
    """Global ranks of the group the call ran on (`()` when unknown): tells which links a call
    used, e.g. whether it crossed a node boundary (`minispeed.zero.stage3.zeropp_ledger`)."""


class CommsLogger:
    """Records every collective issued while it is active (a context manager; nests)."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self.step = 0
        self._previous: CommsLogger | None = None
        self._entered = False

    # -- activation -----------------------------------------------------------------------------
    def __enter__(self) -> CommsLogger:
        global _ACTIVE
        if self._entered:
            raise RuntimeError("this CommsLogger is already active; create a new one to nest")
        self._previous, _ACTIVE, self._entered = _ACTIVE, self, True
        return self

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE, self._previous, self._entered = self._previous, None, False

    # -- recording ------------------------------------------------------------------------------
    def mark_step(self) -> int:
        """Start the next step: later records carry `step + 1`. Returns the new step."""
        self.step += 1
        return self.step

    def add(
        self,
        op: str,
        numel: int,
        dtype: str,
        msg_bytes: int,
        group_size: int,
        latency_s: float,
        wire_bytes: int,
        *,
        async_op: bool = False,
        step: int | None = None,
        impl: str = "native",
        ranks: tuple[int, ...] = (),
    ) -> CommRecord:
        """Append one record, deriving algbw and busbw from the latency."""
        algbw = msg_bytes / latency_s if latency_s > 0 else 0.0
        busbw = algbw * costs.bus_bandwidth_factor(op, group_size)
        rec = CommRecord(
            op=op,
            numel=numel,
            dtype=dtype,
            msg_bytes=msg_bytes,
            group_size=group_size,
            latency_s=latency_s,
            algbw=algbw,
            busbw=busbw,
            wire_bytes=wire_bytes,
            async_op=async_op,
            step=self.step if step is None else step,
            impl=impl,
            ranks=ranks,
        )
        self.records.append(rec)
        return rec

    # -- queries --------------------------------------------------------------------------------
    def filter(self, op: str | None = None, step: int | None = None) -> list[CommRecord]:
        """Records of `op` (all ops when `None`) in `step` (all steps when `None`)."""
        return [
            r
            for r in self.records
            if (op is None or r.op == op) and (step is None or r.step == step)
        ]

    def count(self, op: str | None = None, step: int | None = None) -> int:
        """Number of calls (of `op`, in `step`)."""
        return len(self.filter(op, step))

    def total_msg_bytes(self, op: str | None = None, step: int | None = None) -> int:
        """Sum of message sizes (of `op`, in `step`)."""
        return sum(r.msg_bytes for r in self.filter(op, step))

    def total_wire_bytes(self, op: str | None = None, step: int | None = None) -> int:
        """Sum of bytes this rank sent (of `op`, in `step`)."""
        return sum(r.wire_bytes for r in self.filter(op, step))

    def clear(self) -> None:
        """Forget every record and reset the step counter to 0."""
        self.records.clear()
        self.step = 0

    # -- reports --------------------------------------------------------------------------------
    def aggregate(self) -> list[dict[str, Any]]:
        """One row per (op, msg_bytes, dtype, group_size): count, bytes and mean latency/bandwidth."""
        groups: dict[tuple, list[CommRecord]] = defaultdict(list)
        for r in self.records:
            groups[(r.op, r.msg_bytes, r.dtype, r.group_size)].append(r)
        rows = []
        for (op, msg, dtype, n), recs in sorted(groups.items(), key=lambda kv: kv[0][:2]):
            lat = sum(r.latency_s for r in recs) / len(recs)
            algbw = msg / lat if lat > 0 else 0.0
            rows.append(
                {
                    "op": op,
                    "msg_bytes": msg,
                    "dtype": dtype,
                    "group_size": n,
                    "count": len(recs),
                    "total_msg_bytes": msg * len(recs),
                    "total_wire_bytes": sum(r.wire_bytes for r in recs),
                    "mean_latency_s": lat,
                    "algbw": algbw,
                    "busbw": algbw * costs.bus_bandwidth_factor(op, n),
                }
            )
        return rows

    def summary(self, print_table: bool = True) -> Any:
        """A rich table per op and size (printed unless `print_table=False`); returns it."""
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"comms log: {len(self.records)} calls, {self.step + 1} step(s)")
        for col in ("op", "size", "dtype", "n", "count", "sent/rank", "latency", "algbw", "busbw"):
            table.add_column(col, justify="left" if col in ("op", "dtype") else "right")
        for row in self.aggregate():
            table.add_row(
                row["op"],
                _fmt_bytes(row["msg_bytes"]),
                row["dtype"].removeprefix("torch."),
                str(row["group_size"]),
                str(row["count"]),
                _fmt_bytes(row["total_wire_bytes"]),
                f"{row['mean_latency_s'] * 1e6:,.1f} us",
                f"{row['algbw'] / 1e9:.3f} GB/s",
                f"{row['busbw'] / 1e9:.3f} GB/s",
            )
        if print_table:
            Console().print(table)
        return table

    def to_dict(self) -> dict[str, Any]:
        """Every record plus totals, as plain JSON-able values."""
        return {
            "version": 1,
            "steps": self.step + 1,
            "total_msg_bytes": self.total_msg_bytes(),
            "total_wire_bytes": self.total_wire_bytes(),
            "records": [dataclasses.asdict(r) for r in self.records],
            "summary": self.aggregate(),
        }

    def to_json(self, path: str | os.PathLike) -> None:
        """Write `to_dict` to `path` atomically: temp file in the same folder, fsync, rename."""
        atomic_write_json(path, self.to_dict())


def comms_logger() -> CommsLogger | None:
    """The logger that is recording now, or `None` when logging is off."""
    return _ACTIVE


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n} B"
