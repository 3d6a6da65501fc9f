"""`minispeed.core.ranges.range` reaches torch.profiler's trace by name, and costs nothing otherwise."""

import torch
from torch.profiler import ProfilerActivity, profile

from minispeed.core import ranges


def test_range_names_appear_in_a_cpu_profile_as_context_and_decorator():
    @ranges.range("test.decorated")
    def work(x):
        return x @ x

    x = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with ranges.range("test.outer"):
            work(x)
        work(x)
    names = [e.name for e in prof.events()]
    assert names.count("test.outer") == 1
    assert names.count("test.decorated") == 2


def test_range_outside_a_profiler_records_nothing_and_nests():
    with ranges.range("a"), ranges.range("b"):
        pass
    r = ranges.range("c")
    with r:
        assert r._record is None  # no profiler: no record_function entered


def test_enable_nvtx_without_a_binding_reports_off(monkeypatch):
    monkeypatch.setattr(ranges, "_find_nvtx", lambda: None)
    assert ranges.enable_nvtx(True) is False
    assert ranges.nvtx_enabled() is False
    with ranges.range("still.works"):
        pass
    ranges.enable_nvtx(False)


def test_enabled_nvtx_pushes_and_pops_nested_ranges_in_order(monkeypatch):
    events = []
    pair = (lambda name: events.append(f"push {name}"), lambda: events.append("pop"))
    monkeypatch.setattr(ranges, "_find_nvtx", lambda: pair)
    assert ranges.enable_nvtx(True) is True
    try:
        with ranges.range("a"), ranges.range("b"):
            pass
        ranges.range("c")(lambda: None)()
    finally:
        ranges.enable_nvtx(False)
    assert events == ["push a", "push b", "pop", "pop", "push c", "pop"]


def test_a_timer_sums_the_seconds_inside_its_ranges_only_while_open():
    import time

    with ranges.Timer("t.phase") as timer:
        with ranges.range("t.phase"):
            time.sleep(0.05)
        with ranges.range("t.other"):  # another name: not counted
            time.sleep(0.25)

        @ranges.range("t.phase")
        def phase() -> None:
            time.sleep(0.02)

        phase()
    inside = timer.seconds
    assert 0.07 <= inside < 0.25, inside
    with ranges.range("t.phase"):  # closed: the sum stays
        time.sleep(0.02)
    assert timer.seconds == inside
    assert "t.phase" not in ranges._timers  # no listener left behind: ranges cost a dict read
