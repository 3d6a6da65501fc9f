"""The fetch trace and its cross-rank checks: what makes a ZeRO-3 divergence an error, not a hang.

`FetchTrace` records the order in which modules start and end in the first forward (and start
their backward in the first backward), then follows it in later passes, telling the coordinator
which units come next (for prefetching) and whether this rank is still on the trace.

Collectives pair up by issue order. If ranks run parameter-owning modules in different orders,
rank 0's all-gather of module A meets rank 1's all-gather of module B: a hang, or garbage when the
sizes happen to match. `agree_across_ranks` is the check run at chosen points of a pass: every
rank contributes (phase, position, fingerprint of what it is about to do); if any differ, all
ranks learn it from the same collective and raise `FetchOrderError` together, naming what each
rank ran at the first position where they differ.

Costs: the trace is one small tuple per module call. Checks: one all-gather of 3 int64 per rank
(``24·N`` bytes message) per check: per module start while recording (``first``) or in every
pass (``every``), plus one per forward; on a mismatch one more ``all_gather_object`` of the
descriptions (the run is over anyway).
"""

from __future__ import annotations

import enum
import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

import minispeed.comm as comm
from minispeed.core.accelerator import get_accelerator
from minispeed.core.logging import get_logger
from minispeed.zero.stage3.params import FetchUnit

__all__ = ["FetchOrderError", "FetchTrace", "TraceCheck", "TraceState", "agree_across_ranks"]

_log = get_logger("zero")

# Note [how divergence is caught]
# * While a trace is being recorded (the first forward, or after a change of control flow), every
#   module start is preceded by a tiny all-gather of (phase, position, fingerprint of the module
#   name). The fetch that would pair wrongly is never issued: all ranks see the mismatch in the
#   same collective and raise together. Cost: one 24·N-byte collective per module, once.
# * Later forwards follow the verified trace and issue *exactly* the trace's collectives (fetches
#   and prefetches are a function of the trace position). A rank whose next module differs from
#   the trace knows it at once, and knows which collectives the others will issue until the end
#   of the forward: the trace's. It *replays* them (gathers and releases, no compute), so nobody
#   waits on a missing partner, then joins the one check every rank makes at the end of each
#   forward with (position, module) of its divergence. Everyone raises there, naming the module.
#   If every rank diverged identically (eval-only branch, a data-dependent branch all ranks took),
#   nothing is wrong: the trace is dropped and re-recorded, with checks, for the rest of the pass.
# * Backward order is a function of the forward graph, already checked, so backward is checked
#   only in ``every`` mode; a backward that leaves its trace just stops prefetching (all ranks
#   leave it at the same point) and records a new trace next time.
# * Not detectable: ranks that run the same modules but read different parameters in them
#   without our hooks seeing it, or give different parameters gradients (reduce-scatter buckets
#   then differ). Use set_leaf_module for modules with data-dependent children.


class FetchOrderError(RuntimeError):
    """Ranks run parameter-owning modules in different orders (raised on every rank)."""


class TraceCheck(enum.Enum):
    """How much cross-rank checking of the fetch order runs (see Note [how divergence is caught])."""

    OFF = "off"  # nothing; a divergence hangs until the collective timeout
    FIRST = "first"  # every module start while recording, then one check per forward
    EVERY = "every"  # every module start and backward start of every pass (debug)

    @classmethod
    def from_config(cls, config: Any) -> TraceCheck:
        """``MINISPEED_ZERO3_TRACE_CHECK`` when set (a one-run override), else the config's field."""
        value = os.environ.get("MINISPEED_ZERO3_TRACE_CHECK") or config.stage3_trace_check
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"stage-3 trace check {value!r} is not one of {[m.value for m in cls]}; "
                f"set ZeroConfig.stage3_trace_check (or MINISPEED_ZERO3_TRACE_CHECK) to 'first' "
                f"(default), 'every' (debug) or 'off'"
            ) from None


_PHASE_CODE = {"forward": 1, "backward": 2, "call": 3, "end": 4}

# Note [the grad mode is part of the end-of-forward check]
# Every forward follows the same trace, so ranks that run *different numbers* of forwards (an
# evaluation loop over 3 batches on one rank and 5 on another) pass every module check: their
# passes pair up one by one. The mismatch surfaces when one rank goes back to training while the
# other still evaluates: its backward's all-gathers and reduce-scatters meet the other's forward
# all-gathers (gloo aborts a process on the size mismatch). So the one check every forward makes
# at its end carries the grad mode: the first pass where one rank trains and another evaluates
# raises on every rank, before any backward collective. (Uneven passes that are all evaluations
# and end in a collective of the user's own are beyond our sight.)


def agree_across_ranks(
    group: Any,
    phase: str,
    pos: int,
    fingerprint: int,
    what: str,
    describe: Callable[[str, int], str],
) -> None:
    """All-gather (phase, position, fingerprint); on any mismatch raise on every rank.

    ``what`` describes this rank's event at ``pos``; ``describe(phase, p)`` what this rank ran at
    an earlier position ``p`` (used when another rank diverged before this one's ``pos``).
    """
    n = comm.get_world_size(group)
    device = get_accelerator().device()
    mine = torch.tensor([_PHASE_CODE[phase], pos, fingerprint], dtype=torch.int64, device=device)
    rows = torch.empty(3 * n, dtype=torch.int64, device=device)  # rank-major (n, 3)
    comm.all_gather_into_tensor(rows, mine, group=group)
    table = rows.view(n, 3).tolist()
    if all(row == table[0] for row in table):
        return
    first_pos = min(row[1] for row in table)
    mine_text = what if pos == first_pos else describe(phase, first_pos)
    whats = comm.all_gather_object(mine_text, group=group)
    lines = "\n".join(f"  rank {r}: {w}" for r, w in enumerate(whats))
    if all(row[:2] == [_PHASE_CODE["end"], first_pos] for row in table):
        raise FetchOrderError(
            f"stage 3: ranks ran different numbers of forward passes, or the same pass with and "
            f"without gradients, so one rank's backward collectives would meet another's forward "
            f"(a hang or a crash). At the end of the same forward pass:\n{lines}\nEvery rank "
            f"must run the same number of forwards, each in the same grad mode: evaluate the same "
            f"number of batches on every rank (pad or drop the uneven last batch, e.g. "
            f"DistributedSampler(drop_last=True)), and use torch.no_grad() on all ranks or none"
        )
    raise FetchOrderError(
        f"stage 3: ranks run the modules that own parameters in different orders, so their "
        f"parameter all-gathers would pair up wrongly and hang. First difference ({phase} "
        f"position {first_pos}):\n{lines}\nEvery rank must call those modules in the same "
        f"order. Fix: make the control flow the same on every rank (run every branch, mask the "
        f"result), or mark the module whose children are chosen by data with "
        f"zero.set_leaf_module(module) so its whole subtree is fetched at once before it runs"
    )


class TraceState(enum.Enum):
    """Where one direction's trace (the forward's or the backward's) stands.

    | state | the pass | the trace kept |
    |---|---|---|
    | NEW | none ran yet | none |
    | RECORDING | has no trace: each event is appended (and checked) | none yet |
    | RECORDED | the recording pass ended | what it recorded: the next pass follows it |
    | FOLLOWING | runs the trace: events must match it, upcoming units are known | the trace |
    | DIVERGED | left the trace: events are checked, neither followed nor recorded | none: record again |

    Transitions, each one method of `_Track` that asserts its source: `begin` (any -> RECORDING
    or FOLLOWING: a pass that raised midway never ended), `leave` (FOLLOWING -> DIVERGED), `end`
    (RECORDING -> RECORDED; FOLLOWING and DIVERGED stay). A state outlives its pass until the
    next one begins: modules run between passes (activation-checkpoint recomputation during
    backward, calls outside the root) still see the followed forward trace's upcoming units.
    """

    NEW = "new"
    RECORDING = "recording"
    RECORDED = "recorded"
    FOLLOWING = "following"
    DIVERGED = "diverged"


_IN_PASS = (TraceState.RECORDING, TraceState.FOLLOWING, TraceState.DIVERGED)


class _Track:
    """One direction's trace: the recorded events, this pass's record, and the `TraceState`.

    ``state``, ``events`` and ``record`` are written only here, in the transitions. When a
    recording ends, the trace's module starts are listed once (``starts``), with, for every
    position, where the starts from that position on begin in that list (``first_start``), so
    that `upcoming_units` is one slice per module event, not a walk over the rest of the trace.
    """

    def __init__(self, name: str, units: list[FetchUnit], start_of: Callable) -> None:
        self.name = name
        self.units = units
        self.start_of = start_of  # event -> index of the unit it starts, or None
        self.state = TraceState.NEW
        self.events: list[Any] | None = None  # the trace followed by the next pass
        self.record: list[Any] | None = None  # what this pass appended (RECORDING only)
        self.starts: list[FetchUnit] = []  # the units ``events`` starts, in order
        self.first_start: list[int] = [0]  # position -> index into ``starts``; len(events) + 1

    def begin(self) -> None:
        self.state = TraceState.FOLLOWING if self.events is not None else TraceState.RECORDING
        self.record = [] if self.state is TraceState.RECORDING else None

    def expect(self, states: tuple[TraceState, ...], doing: str) -> None:
        """Assert the state allows ``doing``: each transition asserts its source through this,
        and `FetchTrace` calls it before a transition's cross-rank check, so an illegal move
        raises before it issues a collective the other ranks might not."""
        assert self.state in states, (
            f"stage 3: {doing} while the {self.name} trace is {self.state.value}"
        )

    def append(self, event: Any) -> None:
        self.expect(_IN_PASS, "a module event outside a pass")
        if self.state is TraceState.RECORDING:
            self.record.append(event)

    def leave(self) -> None:
        self.expect((TraceState.FOLLOWING,), "leaving a trace not followed")
        self.state, self.events, self.record = TraceState.DIVERGED, None, None

    def end(self) -> None:
        self.expect(_IN_PASS, "ending a pass that did not begin")
        if self.state is TraceState.RECORDING:
            self.state, self.events, self.record = TraceState.RECORDED, self.record, None
            self.starts, self.first_start = [], [0]
            for index in map(self.start_of, self.events):
                if index is not None:
                    self.starts.append(self.units[index])
                self.first_start.append(len(self.starts))

    def upcoming(self, pos: int) -> list[Any]:
        """The followed trace's events from ``pos`` on (none unless FOLLOWING)."""
        return (self.events or [])[pos:] if self.state is TraceState.FOLLOWING else []

    def upcoming_units(self, pos: int) -> list[FetchUnit]:
        """The units the followed trace starts from ``pos`` on (none unless FOLLOWING)."""
        if self.state is not TraceState.FOLLOWING:
            return []
        return self.starts[self.first_start[min(pos, len(self.events))] :]  # pos is shared


class FetchTrace:
    """The recorded module order of the forward and the backward, and the checks made on it.

    Forward events are ``("pre" | "post", unit index)``; backward events are unit indices in
    backward-start order. ``pos`` is the position in the current pass (shared by both
    directions). Each direction is a `_Track` whose `TraceState` (``forward_state``,
    ``backward_state``) says whether this rank records, follows or left its trace.
    The coordinator calls the ``step_*`` methods at each hook and handles a divergence (the
    collectives it replays are its business); the checks, the recording and the re-sync are here.
    """

    def __init__(self, group: Any, units: list[FetchUnit], check: TraceCheck, stats: Any) -> None:
        self.group = group
        self.units = units
        self.check = check if comm.get_world_size(group) > 1 else TraceCheck.OFF
        self.stats = stats  # FetchStats: trace_checks, retraces
        self._fwd = _Track("forward", units, lambda event: event[1] if event[0] == "pre" else None)
        self._bwd = _Track("backward", units, lambda index: index)
        self.pos = 0

    @property
    def forward_state(self) -> TraceState:
        """The forward trace's state (read-only; `TraceState` lists the transitions)."""
        return self._fwd.state

    @property
    def backward_state(self) -> TraceState:
        """The backward trace's state (read-only)."""
        return self._bwd.state

    @property
    def following(self) -> bool:
        """Whether this rank follows a recorded forward trace."""
        return self._fwd.state is TraceState.FOLLOWING

    # -- forward ----------------------------------------------------------------------------------
    def begin_forward(self) -> None:
        """The root starts: follow the forward trace if there is one, else record it."""
        self.pos = 0
        self._fwd.begin()

    def step_forward(self, kind: str, unit: FetchUnit, what: str, cross_check: bool = True) -> bool:
        """Advance by ``(kind, unit)``; False if this rank just left the trace it follows."""
        if self.following:
            trace = self._fwd.events or []
            if self.pos < len(trace) and trace[self.pos] == (kind, unit.index):
                self.pos += 1
                if cross_check and self.check is TraceCheck.EVERY:
                    self.agree("forward", self.pos - 1, unit.fingerprint(kind), what)
                return True
            return False
        self._fwd.expect(_IN_PASS, "a module event outside a pass")
        if cross_check and self.check is not TraceCheck.OFF:
            self.agree("forward", self.pos, unit.fingerprint(kind), what)
        self._fwd.append((kind, unit.index))
        self.pos += 1
        return True

    def upcoming_forward(self) -> list[FetchUnit]:
        """The units that start after ``pos`` in the followed forward trace (none if none)."""
        return self._fwd.upcoming_units(self.pos)

    def check_demand(self, what: str) -> None:
        """A module read a released parameter by attribute (not in the trace): check it."""
        if self.check is not TraceCheck.OFF:
            self.agree("forward", self.pos, zlib.crc32(what.encode()) & 0x7FFFFFFF, what)

    def forward_complete(self) -> bool:
        """At the root's end: False if this rank follows a trace and has not reached its end."""
        return not self.following or self.pos == len(self._fwd.events or ())

    def end_forward(self) -> None:
        """The one check of each forward (Note [the grad mode is part of the end-of-forward
        check]); keep what was recorded as the trace."""
        self._fwd.expect(_IN_PASS, "ending a pass that did not begin")
        if self.check is not TraceCheck.OFF:
            grad = torch.is_grad_enabled()
            what = (
                "ends a forward with gradients (a training step)"
                if grad
                else "ends a forward under no_grad (evaluation)"
            )
            self.agree("end", self.pos, 1 if grad else 2, what)
        self.finish_forward()

    def finish_forward(self) -> None:
        """Keep the recorded forward (none after a re-sync: record again next time)."""
        self._fwd.end()

    # -- divergence -------------------------------------------------------------------------------
    def diverged(self, what: str) -> int:
        """This rank left the trace it follows at ``pos``: raise now (``off``) or return ``pos``.

        Then the coordinator replays the trace's collectives (``first``) with `replay` and calls
        `resync`. See Note [how divergence is caught].
        """
        self._fwd.expect((TraceState.FOLLOWING,), "leaving a trace not followed")
        if self.check is TraceCheck.OFF:
            raise FetchOrderError(
                f"stage 3: at forward position {self.pos} this rank {what}, but the trace recorded "
                f"at the first step expected something else. Other ranks may now wait forever in "
                f"a collective; enable the cross-rank check "
                f"(ZeroConfig(stage3_trace_check='first'))"
            )
        return self.pos

    def replay(self) -> Iterator[tuple[str, FetchUnit]]:
        """The rest of the followed forward trace, advancing ``pos`` as each event is taken."""
        for kind, index in self._fwd.upcoming(self.pos):
            self.pos += 1
            yield kind, self.units[index]

    def resync(self, pos: int, fingerprint: int, what: str) -> None:
        """Meet the other ranks' check for position ``pos`` (raises unless all diverged alike);
        then drop the trace and go on unrecorded, with checks (FOLLOWING -> DIVERGED)."""
        self._fwd.expect((TraceState.FOLLOWING,), "leaving a trace not followed")
        # Non-diverging ranks make this same call at the end of their forward (or, in EVERY
        # mode, at this very position).
        self.agree("forward", pos, fingerprint, what)
        _log.info(
            "stage 3: every rank left the recorded module order at position %d; re-tracing", pos
        )
        self.stats.retraces += 1
        self.pos = pos
        self._fwd.leave()

    def check_call(self, unit: FetchUnit) -> None:
        """A module called outside the root's forward: no trace to follow, check each call.

        (During backward, recomputation by activation checkpointing follows the autograd order,
        which the forward check already made identical on every rank.)
        """
        if self.check is not TraceCheck.OFF:
            self.agree("call", 0, unit.fingerprint("call"), f"module {unit.label} is called")

    # -- backward ---------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        """Backward starts: follow the backward trace if there is one, else record it."""
        self.pos = 0
        self._bwd.begin()

    def step_backward(self, unit: FetchUnit) -> None:
        """``unit`` starts its backward. Leaving the trace only stops prefetching: every rank
        leaves it at the same point (the backward order follows the checked forward)."""
        if self._bwd.state is TraceState.FOLLOWING:
            trace = self._bwd.events or []
            if self.pos >= len(trace) or trace[self.pos] != unit.index:
                self._bwd.leave()
        self._bwd.expect(_IN_PASS, "a module event outside a pass")
        if self.check is TraceCheck.EVERY:
            what = f"module {unit.label} starts its backward"
            self.agree("backward", self.pos, unit.fingerprint("bwd"), what)
        self._bwd.append(unit.index)
        self.pos += 1

    def upcoming_backward(self) -> list[FetchUnit]:
        """The units whose backward starts after ``pos`` in the followed backward trace."""
        return self._bwd.upcoming_units(self.pos)

    def end_backward(self) -> None:
        """Keep what was recorded as the backward trace."""
        self._bwd.end()

    # -- the check --------------------------------------------------------------------------------
    def agree(self, phase: str, pos: int, fingerprint: int, what: str) -> None:
        """Cross-rank check of this point of the pass (`agree_across_ranks`; never with one rank,
        whose check is OFF from the start)."""
        self.stats.trace_checks += 1
        agree_across_ranks(self.group, phase, pos, fingerprint, what, self.describe)

    def describe(self, phase: str, pos: int) -> str:
        """What this rank ran at ``pos`` of the current forward (it followed its trace there)."""
        events = self._fwd.events if self.following else self._fwd.record
        if phase not in ("forward", "end") or not events or pos >= len(events):
            return "(nothing recorded at that position)"
        kind, index = events[pos]
        verb = "starts its forward" if kind == "pre" else "ends its forward"
        return f"module {self.units[index].label} {verb}"
