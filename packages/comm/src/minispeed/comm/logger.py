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

What it records and prints is chosen when it is made (DeepSpeed's `comms_logger` keys, read by
`CommsLoggerConfig` and handed over by `CommsLogger.from_config`): `ops` records only the named
collectives (`prof_all: false` with `prof_ops`); the others run untimed, as with no logger.
`verbose` prints each record on rank 0 as it is added (`verbose`); `callers` records the function
that called each collective (`debug`), and the summary splits by it.

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
import sys
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

from minispeed.comm import costs
from minispeed.core.config import did_you_mean
from minispeed.core.files import atomic_write_json
from minispeed.core.logging import log_rank0
from minispeed.core.sections import Section, key

__all__ = ["CommRecord", "CommsLogger", "CommsLoggerConfig", "comms_logger", "pass_through"]

# The one global the hot path reads. See Note [logger off is one global read].
_ACTIVE: CommsLogger | None = None

# Note [logger off is one global read]
# Collectives sit on the critical path of every training step. With logging off, each call pays
# a single module-global load and an `is None` test; nothing is allocated, no clock is read and
# the accelerator is never synchronized.


# DeepSpeed's names for the collectives (its `deepspeed.comm` functions, the names its `prof_ops`
# lists) that differ from ours (`costs.OPS`): the tensor form of a call and its list form are one
# op here, and so are its point-to-point variants.
DEEPSPEED_OP_NAMES = {
    "all_gather_into_tensor": "all_gather",
    "allgather_fn": "all_gather",
    "all_gather_object": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_fn": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "inference_all_reduce": "all_reduce",
    "broadcast_object_list": "broadcast",
    "isend": "send",
    "irecv": "recv",
    "batch_isend_irecv": "batch_p2p",
}


def _op_names(value: Any) -> tuple[str, ...]:
    """`prof_ops`: op names, ours (`costs.OPS`) or DeepSpeed's (`DEEPSPEED_OP_NAMES`), as ours."""
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"must be a list of collective names, got {value!r}")
    known = set(costs.OPS) | set(DEEPSPEED_OP_NAMES)
    for name in value:
        if name not in known:
            raise ValueError(
                f"{name!r} is not a collective{did_you_mean([name], known)}; use one of "
                f"{', '.join(costs.OPS)} (or DeepSpeed's name of one: "
                f"{', '.join(sorted(DEEPSPEED_OP_NAMES))})"
            )
    return tuple(dict.fromkeys(DEEPSPEED_OP_NAMES.get(v, v) for v in value))


@dataclass(frozen=True)
class CommsLoggerConfig(Section):
    """The comms logger in an engine (DeepSpeed section `comms_logger`): `enabled` records the
    run's collectives into the engine's `CommsLogger` (`CommsLogger.from_config`), every one or
    those named, printing each as it goes if asked."""

    ds_path: ClassVar[str] = "comms_logger"
    ds_auto_is_default: ClassVar[bool] = True  # DeepSpeed: "auto" is the default

    enabled: bool = key("enabled", False)
    """Record collectives into `engine.comms_logger`. (DeepSpeed 0.19.8 turns its logger on
    whenever the section is present, even with `enabled: false`; here `false` means off.)"""
    verbose: bool = key("verbose", False)
    """Print each recorded collective on rank 0 as it completes: op, latency, message size,
    algbw and busbw in Gbit/s (DeepSpeed's line)."""
    all_ops: bool = key("prof_all", True)
    """Record every collective; false: only the ones `prof_ops` names (DeepSpeed `prof_all`)."""
    ops: tuple[str, ...] = key("prof_ops", (), read=_op_names, schema={"type": "array"})
    """The collectives recorded when `prof_all` is false, by name: ours (`all_reduce`,
    `all_gather`, `reduce_scatter`, `all_to_all`, `broadcast`, `send`, ...) or DeepSpeed's
    (`all_gather_into_tensor`, `reduce_scatter_tensor`, `all_to_all_single`, ...). The others
    run untimed (DeepSpeed `prof_ops`)."""
    callers: bool = key("debug", False)
    """Record the function that called each collective (`CommRecord.caller`, the first frame
    outside `minispeed.comm`); the summary then has one row per caller (DeepSpeed `debug`)."""


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
    caller: str = ""
    """The function that issued the call (its qualified name), when the logger records callers
    (`CommsLogger(callers=True)`); `""` otherwise."""


class CommsLogger:
    """Records the collectives issued while it is active (a context manager; nests).

    `ops`: the op names recorded (`costs.OPS`); None, every op. A call of another op runs as
    with no logger (untimed, unsynchronized). `verbose`: log each record on rank 0 as it is
    added. `callers`: record the calling function of each call (a walk up the stack per call).
    """

    def __init__(
        self,
        *,
        ops: Collection[str] | None = None,
        verbose: bool = False,
        callers: bool = False,
    ) -> None:
        if ops is not None:
            unknown = sorted(set(ops) - set(costs.OPS))
            if unknown:
                raise ValueError(f"unknown collectives {unknown}; use names from {costs.OPS}")
        self.ops: frozenset[str] | None = None if ops is None else frozenset(ops)
        self.verbose = verbose
        self.callers = callers
        self.records: list[CommRecord] = []
        self.step = 0
        self._previous: CommsLogger | None = None
        self._entered = False

    @classmethod
    def from_config(cls, config: CommsLoggerConfig) -> CommsLogger:
        """The logger a `comms_logger` section asks for (its `enabled` is the caller's to read)."""
        return cls(
            ops=None if config.all_ops else config.ops,
            verbose=config.verbose,
            callers=config.callers,
        )

    def records_op(self, op: str) -> bool:
        """Whether calls of `op` are recorded."""
        return self.ops is None or op in self.ops

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
        caller: str = "",
    ) -> CommRecord:
        """Append one record, deriving algbw and busbw from the latency (and print it on rank
        0 when `verbose`)."""
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
            caller=caller,
        )
        self.records.append(rec)
        if self.verbose:
            log_rank0(_line(rec))
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
        """One row per (op, caller, msg_bytes, dtype, group_size): count, bytes and mean
        latency/bandwidth (`caller` is `""` unless callers are recorded)."""
        groups: dict[tuple, list[CommRecord]] = defaultdict(list)
        for r in self.records:
            groups[(r.op, r.caller, r.msg_bytes, r.dtype, r.group_size)].append(r)
        rows = []
        for (op, caller, msg, dtype, n), recs in sorted(groups.items(), key=lambda kv: kv[0][:3]):
            lat = sum(r.latency_s for r in recs) / len(recs)
            algbw = msg / lat if lat > 0 else 0.0
            rows.append(
                {
                    "op": op,
                    "caller": caller,
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
                f"{row['op']} ({row['caller']})" if row["caller"] else row["op"],
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


# Modules outside comm whose functions only hand collectives on to it (DeepSpeed's
# `deepspeed.comm` adapter): a caller is looked for above them too.
_PASS_THROUGH: set[str] = set()


def pass_through(module: str) -> None:
    """Declare `module` (a `__name__`) an adapter that only forwards collectives to comm, so
    `CommRecord.caller` names its caller rather than its own function."""
    _PASS_THROUGH.add(module)


def caller_name(skip: int = 1) -> str:
    """The qualified name of the function that called into `minispeed.comm`: the first frame,
    from `skip` frames above this one, whose module is neither part of comm nor declared
    `pass_through` (`"Reducer.flush"`). Cost: one step up the stack per frame skipped."""
    frame = sys._getframe(skip + 1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("minispeed.comm") and module not in _PASS_THROUGH:
            return frame.f_code.co_qualname
        frame = frame.f_back
    return ""


def _line(r: CommRecord) -> str:
    """DeepSpeed's verbose line for one record (bandwidths in Gbit/s)."""
    caller = f" | caller: {r.caller}" if r.caller else ""
    return (
        f"comm op: {r.op}{caller} | time (ms): {r.latency_s * 1e3:.2f} | msg size: "
        f"{_fmt_bytes(r.msg_bytes)} | algbw (Gbps): {r.algbw * 8 / 1e9:.2f} | busbw (Gbps): "
        f"{r.busbw * 8 / 1e9:.2f}"
    )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n} B"
