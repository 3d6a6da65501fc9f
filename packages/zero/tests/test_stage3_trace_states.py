"""The fetch trace's state machine (`TraceState`, trace.py): legal passes move it as documented,
and an illegal transition (leaving a trace never followed, ending a pass never begun, an event
outside a pass) raises at once, before its cross-rank check, instead of corrupting the recorded
order or issuing a collective the other ranks do not.

Two ranks making the same calls, so every cross-rank check agrees and only the transitions are
exercised (on one rank the check is off and a divergence raises `FetchOrderError` at once).
"""

from __future__ import annotations

import pytest

from minispeed.core.testing import run_distributed
from minispeed.zero.stage3.coordinator import FetchStats
from minispeed.zero.stage3.params import FetchUnit
from minispeed.zero.stage3.trace import FetchTrace, TraceCheck, TraceState

_UNITS = [FetchUnit(0, "", "Root", []), FetchUnit(1, "a", "Linear", [])]


def _trace() -> FetchTrace:
    return FetchTrace(None, _UNITS, TraceCheck.FIRST, FetchStats())


def _raises(fn, *args) -> str:
    with pytest.raises(AssertionError) as err:
        fn(*args)
    return str(err.value)


def _one_forward(trace: FetchTrace) -> bool:
    trace.begin_forward()
    started = trace.step_forward("pre", _UNITS[1], "a starts")
    return started and trace.step_forward("post", _UNITS[1], "a ends", cross_check=False)


def _body(rank: int, world_size: int) -> dict:
    illegal = {}
    fresh = _trace()
    illegal["diverge before recording"] = _raises(fresh.diverged, "runs b")
    illegal["end a forward never begun"] = _raises(fresh.end_forward)
    illegal["end a backward never begun"] = _raises(fresh.end_backward)
    illegal["step before begin"] = _raises(fresh.step_forward, "pre", _UNITS[1], "a starts")
    recording = _trace()
    recording.begin_forward()
    illegal["re-sync while recording"] = _raises(recording.resync, 0, 0, "runs b")
    # Each raised before its cross-rank check: no collective a correct rank would not match.
    checks_issued = fresh.stats.trace_checks + recording.stats.trace_checks

    trace, seen = _trace(), []
    seen.append(trace.forward_state)  # NEW
    assert _one_forward(trace)
    seen.append(trace.forward_state)  # RECORDING
    trace.end_forward()
    seen.append(trace.forward_state)  # RECORDED
    illegal["end the recorded pass twice"] = _raises(trace.end_forward)
    trace.begin_forward()
    seen.append(trace.forward_state)  # FOLLOWING
    upcoming = [u.index for u in trace.upcoming_forward()]
    off_trace = trace.step_forward("pre", _UNITS[0], "root starts")  # the trace expects unit 1
    pos = trace.diverged("root starts")
    trace.resync(pos, 0, "root starts")
    seen.append(trace.forward_state)  # DIVERGED
    illegal["leave a left trace"] = _raises(trace.resync, pos, 0, "again")
    trace.finish_forward()
    trace.begin_forward()
    seen.append(trace.forward_state)  # RECORDING again: the trace was dropped
    return dict(
        illegal=illegal,
        seen=[s.value for s in seen],
        upcoming=upcoming,
        off_trace=off_trace,
        checks_issued=checks_issued,
    )


def test_trace_states_move_as_documented_and_illegal_transitions_raise() -> None:
    results = run_distributed(_body, world_size=2, timeout_s=60)
    assert results[0] == results[1]
    result = results[0]
    assert result["seen"] == [
        TraceState.NEW.value,
        TraceState.RECORDING.value,
        TraceState.RECORDED.value,
        TraceState.FOLLOWING.value,
        TraceState.DIVERGED.value,
        TraceState.RECORDING.value,
    ]
    assert result["upcoming"] == [1]
    assert result["off_trace"] is False
    assert result["checks_issued"] == 0
    assert len(result["illegal"]) == 7
    for what, message in result["illegal"].items():
        assert message.startswith("stage 3:"), (what, message)
