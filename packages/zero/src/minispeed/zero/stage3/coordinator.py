"""The fetch coordinator: which parameters to gather when, and proof that every rank agrees.

The hooks (hooks.py) tell the coordinator "module M starts / ends its forward" and "M's backward
is about to run / has run". It answers by gathering M's :class:`FetchUnit` (the parameters M
owns, plus *externals* it was seen reading) and releasing it when nobody holds it any more.

**Trace and prefetch.** The first forward records the sequence of module starts and ends (the
*trace*); the first backward records the order of module backward starts. Later passes follow the
trace: when M starts, the coordinator also issues async all-gathers for the units that come next,
as long as the parameters fetched ahead fit in ``stage3_prefetch_bucket_numel`` elements and the
gathered total stays within ``stage3_max_live_numel``; they are waited for only when their module
starts, so the transfer overlaps M's compute. Parameters with at most
``stage3_param_persistence_threshold_numel`` elements are *persistent*: gathered once, never
released (the strategy marks them), because fetching many tiny tensors costs more latency than
their memory is worth.

**Divergence.** Collectives pair up by issue order. If ranks run parameter-owning modules in
different orders, rank 0's all-gather of A meets rank 1's all-gather of B: a hang (or garbage when
the sizes match). DeepSpeed's most reported ZeRO-3 failure. We turn it into a
:class:`FetchOrderError` on every rank naming the first module where they differ
(See Note [how divergence is caught] in trace.py). Modes (``TraceCheck``): ``first`` (default),
``every`` (debug), ``off``.

Costs: the trace is one small tuple per module call. Checks: one all-gather of 3 int64 per rank
(``24·N`` bytes message) per module start during the first forward (``first``) or every pass
(``every``), plus one per forward in ``first`` mode.
"""

from __future__ import annotations

import enum
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd import Variable

import minispeed.comm as comm
from minispeed.core.logging import get_logger
from minispeed.zero.stage3.params import ParamState, ShardedParam, all_gather_params, release_params
from minispeed.zero.stage3.trace import FetchOrderError, TraceCheck, agree_across_ranks

__all__ = ["FetchCoordinator", "FetchStats", "FetchUnit"]

_log = get_logger("zero")


# Note [reuse distance]
# A module called twice in one pass (a block applied twice, a weight shared by two modules) would
# be fetched, released and fetched again. ``stage3_max_reuse_distance`` (parameter elements, as
# DeepSpeed's key) keeps gathered those parameters of an ending unit that a unit starting later in
# the same pass needs again, if fewer than that many parameter elements are needed in between:
# the upcoming units' parameters are summed in trace order and the scan stops at the distance, as
# DeepSpeed's coordinator counts. Only while following a trace: the decision is a function of
# the trace position, so every rank makes it identically (a diverging rank replaying the trace
# too). Only within one pass: the end of a forward releases everything, so parameters are not
# carried from forward into backward (DeepSpeed does carry them; here a forward that no backward
# follows, such as evaluation, holds nothing afterwards). Kept parameters stay in the live set
# (``stage3_max_live_numel``) and go at their last use or at the end of the pass. Cost: the
# unit's bytes held in between; saved: one all-gather of them per reuse.


class _Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class _Mode(enum.Enum):
    RECORDING = "recording"  # no trace yet: check every start, fetch synchronously
    FOLLOWING = "following"  # follow the trace: prefetch ahead, check once per pass


@dataclass(eq=False)
class FetchUnit:
    """The parameters gathered together when one module runs.

    ``params``: the module's own parameters (its whole subtree for a leaf module, see
    ``set_leaf_module``), then externals: parameters of other modules it read during forward.
    Persistent parameters may be listed; they are simply always gathered.
    """

    index: int
    name: str  # qualified module name ("" for the root)
    kind: str  # module class name, for messages
    params: list[ShardedParam]

    @property
    def label(self) -> str:
        return f"'{self.name or '<root>'}' ({self.kind})"

    def fingerprint(self, what: str) -> int:
        """A rank-independent 31-bit hash of (event, module name): same module, same number."""
        return zlib.crc32(f"{what}:{self.name}".encode()) & 0x7FFFFFFF


@dataclass
class FetchStats:
    """Counters for tests and the docs' trace: what the coordinator did so far."""

    fetch_calls: int = 0  # synchronous all-gathers issued at a module start (or on demand)
    prefetch_calls: int = 0  # async all-gathers issued ahead of use
    demand_fetches: int = 0  # parameters fetched because a module read them by attribute
    trace_checks: int = 0  # cross-rank checks (24·N-byte all-gathers)
    retraces: int = 0  # times every rank left the trace identically and it was re-recorded
    peak_live_numel: int = 0  # most non-persistent parameter elements gathered at once
    live_budget_stops: int = 0  # prefetches cut short by stage3_max_live_numel
    events: list[str] = field(default_factory=list)  # fetch/release log when ``log_events``


class FetchCoordinator:
    """Gathers and releases FetchUnits as modules run; records, follows and checks the trace."""

    def __init__(
        self,
        group: Any,
        units: list[FetchUnit],
        *,
        prefetch_numel: int,
        max_live_numel: int,
        check: TraceCheck,
        reuse_numel: int = 0,
    ) -> None:
        self.group = group
        self.world_size = comm.get_world_size(group)
        self.units = units
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.reuse_numel = reuse_numel
        self.check = check if self.world_size > 1 else TraceCheck.OFF  # one rank cannot diverge
        self.stats = FetchStats()
        self.log_events = False
        self.phase = _Phase.IDLE
        self.stack: list[FetchUnit] = []  # units of the modules running forward, innermost last
        self._live: dict[ShardedParam, None] = {}  # non-persistent params fetched by us
        self._fwd_trace: list[tuple[str, int]] | None = None  # ("pre"|"post", unit index)
        self._bwd_trace: list[int] | None = None  # unit indices, in backward-start order
        self._mode = _Mode.RECORDING
        self._record: list[Any] | None = None
        self._pos = 0
        self._bwd_held: Counter[FetchUnit] = Counter()
        self._bwd_follow = False

    # -- forward ----------------------------------------------------------------------------------
    @property
    def in_forward(self) -> bool:
        """Whether a module run by our hooks is executing (demand fetches are allowed)."""
        return bool(self.stack)

    def begin_forward(self) -> None:
        """The root module starts: follow the trace if there is one, else record it."""
        if self.phase is not _Phase.IDLE or self.stack:
            self._recover()
        self.phase = _Phase.FORWARD
        self._pos = 0
        if self._fwd_trace is None:
            self._mode, self._record = _Mode.RECORDING, []
        else:
            self._mode, self._record = _Mode.FOLLOWING, None

    def pre_forward(self, unit: FetchUnit) -> None:
        """Module ``unit`` starts its forward: its parameters must be gathered on return."""
        if self.phase is _Phase.FORWARD:
            self._on_event(("pre", unit.index), unit, "starts its forward")
        elif self.phase is _Phase.IDLE and self.check is not TraceCheck.OFF:
            # A module called outside the root's forward: no trace to follow, check each call.
            # (During backward, recomputation by activation checkpointing follows the autograd
            # order, which the forward check already made identical on every rank.)
            self._agree("call", 0, unit.fingerprint("call"), f"module {unit.label} is called")
        self._acquire(unit)
        self.stack.append(unit)
        if self.phase is _Phase.FORWARD and self._mode is _Mode.FOLLOWING:
            self._prefetch(self._upcoming_forward(), unit)

    def post_forward(self, unit: FetchUnit) -> None:
        """Module ``unit`` finished its forward: release what nobody else holds."""
        if self.phase is _Phase.FORWARD:
            self._on_event(("post", unit.index), unit, "ends its forward", cross_check=False)
        if self.stack and self.stack[-1] is unit:
            self.stack.pop()
        elif unit in self.stack:
            self.stack.reverse()
            self.stack.remove(unit)
            self.stack.reverse()
        self._unhold(unit, self._reused_soon(unit, self._upcoming_forward()))

    def end_forward(self) -> None:
        """The root module returned: verify the pass, release prefetched leftovers."""
        if self.phase is not _Phase.FORWARD:
            return
        if self._mode is _Mode.FOLLOWING and self._pos != len(self._fwd_trace or ()):
            self._diverged(("end", -1), None, "reaches the end of its forward")
        elif self.check is not TraceCheck.OFF:
            # Note [the grad mode is part of the end-of-forward check] (trace.py).
            grad = torch.is_grad_enabled()
            self._agree(
                "end",
                self._pos,
                1 if grad else 2,
                "ends a forward with gradients (a training step)"
                if grad
                else "ends a forward under no_grad (evaluation)",
            )
        self._release_unclaimed()
        if self._mode is _Mode.RECORDING:
            self._fwd_trace = self._record  # None after a re-sync: record again next time
        self.phase = _Phase.IDLE

    def demand_fetch(self, sp: ShardedParam, what: str) -> None:
        """A running module read a released parameter by attribute: fetch it, make it an external.

        It is charged to the innermost running module, which holds it until it ends and fetches
        it with its own parameters from the next pass on (so steady-state passes have no demand
        fetches; one there means control flow changed, and is treated as a divergence).
        """
        unit = self.stack[-1]
        if self.phase is _Phase.FORWARD:
            index = unit.index * 100_003 + len(unit.params)
            if self._mode is _Mode.FOLLOWING:
                self._diverged(("get", index), unit, f"reads {what} inside {unit.label}")
            if self.check is not TraceCheck.OFF:
                self._agree(
                    "forward",
                    self._pos,
                    zlib.crc32(what.encode()) & 0x7FFFFFFF,
                    f"reads {what} inside {unit.label}",
                )
        self.stats.demand_fetches += 1
        unit.params.append(sp)
        self._fetch([sp], unit)
        sp.holds += 1

    # -- backward ---------------------------------------------------------------------------------
    def pre_backward(self, unit: FetchUnit) -> None:
        """Gradients reached ``unit``'s outputs: gather it again before its backward runs."""
        if self.phase is not _Phase.BACKWARD:
            self._begin_backward()
        if self._bwd_follow:
            trace = self._bwd_trace or []
            if self._pos >= len(trace) or trace[self._pos] != unit.index:
                self._bwd_follow = False  # every rank leaves the trace here: stop prefetching
                self._bwd_trace = None
        if self.check is TraceCheck.EVERY:
            self._agree(
                "backward",
                self._pos,
                unit.fingerprint("bwd"),
                f"module {unit.label} starts its backward",
            )
        if self._record is not None:
            self._record.append(unit.index)
        self._pos += 1
        self._acquire(unit)
        self._bwd_held[unit] += 1
        if self._bwd_follow:
            self._prefetch((self.units[i] for i in (self._bwd_trace or [])[self._pos :]), unit)

    def post_backward(self, unit: FetchUnit) -> None:
        """Gradients for ``unit``'s inputs are computed: its parameters may go."""
        if self._bwd_held[unit] <= 0:
            return
        self._bwd_held[unit] -= 1
        upcoming = (self.units[i] for i in (self._bwd_trace or [])[self._pos :])
        self._unhold(unit, self._reused_soon(unit, upcoming) if self._bwd_follow else set())

    def end_backward(self) -> None:
        """Autograd finished (queued callback): release everything fetched for backward."""
        if self.phase is not _Phase.BACKWARD:
            return
        for unit, count in list(self._bwd_held.items()):
            for _ in range(count):
                self._unhold(unit)
        self._bwd_held.clear()
        self._release_unclaimed()
        if self._record is not None:
            self._bwd_trace = self._record
        self._record = None
        self.phase = _Phase.IDLE

    def _begin_backward(self) -> None:
        if self.phase is _Phase.FORWARD:  # the forward raised midway; start clean
            self._recover()
        self.phase = _Phase.BACKWARD
        self._pos = 0
        self._bwd_follow = self._bwd_trace is not None
        self._record = None if self._bwd_follow else []
        Variable._execution_engine.queue_callback(self.end_backward)

    # -- gathering and releasing ------------------------------------------------------------------
    def _fetch(self, sps: list[ShardedParam], unit: FetchUnit | None) -> None:
        """Gather ``sps`` synchronously (waiting for ones already in flight)."""
        missing = [sp for sp in sps if sp.state is ParamState.SHARDED]
        if missing:
            self.stats.fetch_calls += 1
            self._note("fetch", missing, unit)
            all_gather_params(missing)
            self._track(missing)
        for sp in sps:
            if sp.state is ParamState.GATHERING:
                sp.to_gathered()

    def _acquire(self, unit: FetchUnit) -> None:
        self._fetch(unit.params, unit)
        for sp in unit.params:
            sp.holds += 1

    def _unhold(self, unit: FetchUnit, keep: set[ShardedParam] | None = None) -> None:
        for sp in unit.params:
            sp.holds = max(0, sp.holds - 1)
        release = [sp for sp in unit.params if not keep or sp not in keep]
        self._note("release", release_params(release), unit)

    def _reused_soon(self, unit: FetchUnit, upcoming: Iterator[FetchUnit]) -> set[ShardedParam]:
        """``unit``'s parameters that a unit starting within ``reuse_numel`` elements needs again.

        Note [reuse distance]: they stay gathered instead of being released and fetched again.
        """
        if self.phase is _Phase.FORWARD and self._mode is not _Mode.FOLLOWING:
            return set()
        mine, keep, seen = set(unit.params), set(), 0
        for later in upcoming:
            if seen >= self.reuse_numel:
                break
            for sp in later.params:
                if sp in mine:
                    keep.add(sp)
                seen += sp.padded_numel
        return keep

    def _prefetch(self, upcoming: Iterator[FetchUnit], current: FetchUnit) -> None:
        """Fetch ahead the next units that fit the prefetch and live budgets: ONE async all-gather.

        The window counts the upcoming units' parameters that no running module holds (already
        in flight or not), so it slides: each module start tops it up by what was consumed.
        """
        ahead, seen, batch = 0, set(), []
        live = self._live_numel()
        for unit in upcoming:
            fresh = [
                sp for sp in unit.params if not sp.persistent and sp.holds == 0 and sp not in seen
            ]
            seen.update(fresh)
            numel = sum(sp.padded_numel for sp in fresh)
            if ahead + numel > self.prefetch_numel:
                break
            missing = [sp for sp in fresh if sp.state is ParamState.SHARDED]
            extra = sum(sp.padded_numel for sp in missing)
            if live + extra > self.max_live_numel:
                self.stats.live_budget_stops += 1
                break
            ahead, live = ahead + numel, live + extra
            batch += missing
        if batch:
            self.stats.prefetch_calls += 1
            self._note("prefetch", batch, current)
            all_gather_params(batch, async_op=True)
            self._track(batch)

    def _track(self, sps: list[ShardedParam]) -> None:
        for sp in sps:
            if not sp.persistent:
                self._live[sp] = None
        self.stats.peak_live_numel = max(self.stats.peak_live_numel, self._live_numel())

    def _live_numel(self) -> int:
        for sp in [sp for sp in self._live if sp.state is ParamState.SHARDED]:
            del self._live[sp]
        return sum(sp.padded_numel for sp in self._live)

    def _release_unclaimed(self) -> None:
        """Release prefetched parameters nobody claimed (the pass ended before their module ran)."""
        self._note("release", release_params(list(self._live)), None)
        self._live_numel()

    def _note(self, what: str, sps: list[ShardedParam], unit: FetchUnit | None) -> None:
        """With ``log_events``: one line per fetch/prefetch/release, with gathered bytes."""
        if self.log_events and sps:
            nbytes = sum(sp.padded_numel * sp.shard.element_size() for sp in sps)
            where = unit.label if unit is not None else "(end of pass)"
            self.stats.events.append(
                f"{self.phase.value:8} {where:32} {what:8} {nbytes:7d} B  "
                + " ".join(sp.name for sp in sps)
            )

    # -- the trace and its checks -----------------------------------------------------------------
    def _upcoming_forward(self) -> Iterator[FetchUnit]:
        for kind, index in (self._fwd_trace or [])[self._pos :]:
            if kind == "pre":
                yield self.units[index]

    def _on_event(
        self, event: tuple[str, int], unit: FetchUnit, what: str, cross_check: bool = True
    ) -> None:
        """Advance the forward trace by ``event``; on a mismatch handle the divergence."""
        if self._mode is _Mode.FOLLOWING:
            trace = self._fwd_trace or []
            if self._pos < len(trace) and trace[self._pos] == event:
                self._pos += 1
                if cross_check and self.check is TraceCheck.EVERY:
                    self._agree(
                        "forward",
                        self._pos - 1,
                        unit.fingerprint(event[0]),
                        f"module {unit.label} {what}",
                    )
                return
            self._diverged(event, unit, f"module {unit.label} {what}")
        if cross_check and self.check is not TraceCheck.OFF:
            self._agree(
                "forward", self._pos, unit.fingerprint(event[0]), f"module {unit.label} {what}"
            )
        if self._record is not None:
            self._record.append(event)
        self._pos += 1

    def _diverged(self, event: tuple[str, int], unit: FetchUnit | None, what: str) -> None:
        """This rank left the trace at ``self._pos``. See Note [how divergence is caught]."""
        pos = self._pos
        fingerprint = unit.fingerprint(event[0]) if unit is not None else 0
        if self.check is TraceCheck.OFF:
            raise FetchOrderError(
                f"stage 3: at forward position {pos} this rank {what}, but the trace recorded at the "
                f"first step expected something else. Other ranks may now wait forever in a "
                f"collective; enable the cross-rank check (ZeroConfig(stage3_trace_check='first'))"
            )
        if self.check is TraceCheck.FIRST:
            # Issue the collectives of trace[pos:], as the ranks that follow it do.
            for kind, index in (self._fwd_trace or [])[pos:]:
                self._pos += 1
                if kind == "pre":
                    self._acquire(self.units[index])
                    self._prefetch(self._upcoming_forward(), self.units[index])
                else:
                    unit = self.units[index]
                    self._unhold(unit, self._reused_soon(unit, self._upcoming_forward()))
            self._release_unclaimed()
        # Non-diverging ranks make this same call at the end of their forward (or, in EVERY
        # mode, at this very position).
        self._agree("forward", pos, fingerprint, what)
        # Every rank diverged identically: a legitimate change of control flow. Re-sync.
        _log.info(
            "stage 3: every rank left the recorded module order at position %d; re-tracing", pos
        )
        self.stats.retraces += 1
        if self.check is TraceCheck.FIRST:
            for running in self.stack:
                self._acquire(running)
        self._pos = pos
        self._mode, self._record, self._fwd_trace = _Mode.RECORDING, None, None

    def _agree(self, phase: str, pos: int, fingerprint: int, what: str) -> None:
        """Cross-rank check of this point of the pass (trace.agree_across_ranks)."""
        if self.world_size > 1:
            self.stats.trace_checks += 1
            agree_across_ranks(self.group, phase, pos, fingerprint, what, self._describe)

    def _describe(self, phase: str, pos: int) -> str:
        """What this rank ran at ``pos`` of the current pass (it followed its trace up to there)."""
        events = self._fwd_trace if self._mode is _Mode.FOLLOWING else self._record
        if phase not in ("forward", "end") or not events or pos >= len(events):
            return "(nothing recorded at that position)"
        kind, index = events[pos]
        verb = "starts its forward" if kind == "pre" else "ends its forward"
        return f"module {self.units[index].label} {verb}"

    def _recover(self) -> None:
        """A previous pass raised midway: drop what it held so the next pass starts clean."""
        _log.warning(
            "stage 3: the previous forward/backward did not finish; releasing its parameters"
        )
        for unit in self.stack:
            self._unhold(unit)
        self.stack.clear()
        for unit, count in list(self._bwd_held.items()):
            for _ in range(count):
                self._unhold(unit)
        self._bwd_held.clear()
        self._release_unclaimed()
        self.phase = _Phase.IDLE
