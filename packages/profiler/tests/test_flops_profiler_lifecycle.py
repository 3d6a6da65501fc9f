"""A profiler's life: stopping one that never started and starting one already running are
refused with an error naming the fix; stopped, it keeps its counts and adds to them when
entered again."""

import pytest
import torch
from torch import nn

from minispeed.profiler import FlopsProfiler, formulas

B, K, N = 3, 4, 5


def _linear():
    torch.manual_seed(0)
    return nn.Linear(K, N)


def test_stopping_a_profiler_that_never_started_is_refused():
    prof = FlopsProfiler(_linear())
    with pytest.raises(RuntimeError, match=r"not running.*Start it first"):
        prof.__exit__(None, None, None)
    assert prof.result().wall_s == 0.0  # not the ~2,000 s since the clock's epoch


def test_entering_a_running_profiler_again_is_refused_and_counts_stay_single():
    lin = _linear()
    prof = FlopsProfiler(lin)
    with prof:
        with pytest.raises(RuntimeError, match=r"already running.*twice"), prof:
            pass
        lin(torch.randn(B, K))
    assert prof.result().forward == formulas.matmul(B, K, N, bias=True)  # counted once
    with pytest.raises(RuntimeError, match="not running"):
        prof.__exit__(None, None, None)  # and it was stopped once, by the outer block


def test_a_stopped_profiler_entered_again_adds_to_its_counts():
    lin = _linear()
    prof = FlopsProfiler(lin)
    for _ in range(2):
        with prof:
            lin(torch.randn(B, K))
    r = prof.result()
    one = formulas.matmul(B, K, N, bias=True)
    assert r.forward == one + one
    assert r.module("").calls == 2
    prof.reset_profile()
    assert prof.result().forward.flops == 0
