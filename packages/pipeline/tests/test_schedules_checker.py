"""The checker proves a schedule safe before it runs, and names what is wrong when it is not."""

import pytest

import minispeed.pipeline as pp
from minispeed.pipeline import (
    Backward,
    Forward,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)


class _Handwritten(pp.PipeSchedule):
    """A two-stage schedule given as literal programs."""

    name = "handwritten"

    def __init__(self, programs):
        super().__init__(micro_batches=2, stages=2)
        self._programs = programs

    def program(self, stage):
        return self._programs[stage]


def _fwd0(m):
    return [LoadMicroBatch(m), Forward(m), SendActivation(m, peer=1)]


def _last(m):
    return [
        LoadMicroBatch(m),
        RecvActivation(m, peer=0),
        Forward(m),
        Backward(m),
        SendGrad(m, peer=0),
    ]


def test_every_builtin_schedule_passes():
    for p, m in [(1, 1), (2, 2), (2, 7), (3, 6), (4, 8)]:
        pp.check(pp.GPipe(m, p))
        pp.check(pp.OneFOneB(m, p))
        pp.check(pp.ZeroBubbleH1(m, p))
        pp.check(pp.InferenceSchedule(m, p))
        if m % p == 0:
            pp.check(pp.Interleaved1F1B(m, p, 2))
            pp.check(pp.InferenceSchedule(m, p, 2))


def test_receives_out_of_order_are_named():
    bad = _Handwritten([
        _fwd0(0) + _fwd0(1) + [RecvGrad(1, peer=1), Backward(1), RecvGrad(0, peer=1), Backward(0)],
        _last(0) + _last(1),
    ])  # fmt: skip
    with pytest.raises(
        pp.ScheduleError, match=r"grad of micro-batch 0.*not the grad of micro-batch 1"
    ):
        pp.check(bad)


def test_a_deadlock_names_each_blocked_stage():
    # stage 0 waits for a gradient before sending the activation stage 1 waits for
    bad = _Handwritten([
        [LoadMicroBatch(0), Forward(0), RecvGrad(0, peer=1), SendActivation(0, peer=1), Backward(0),
         *_fwd0(1), RecvGrad(1, peer=1), Backward(1)],
        _last(0) + _last(1),
    ])  # fmt: skip
    with pytest.raises(
        pp.ScheduleError,
        match=r"deadlocks: stage 0 waits at RecvGrad.*stage 1 waits at RecvActivation",
    ):
        pp.check(bad)


def test_a_backward_before_its_forward_and_a_lost_message_are_caught():
    with pytest.raises(pp.ScheduleError, match="must follow"):
        pp.check(_Handwritten([[Backward(0)], []]))
    with pytest.raises(pp.ScheduleError, match="never received"):
        pp.check(_Handwritten([_fwd0(0) + _fwd0(1) + [RecvGrad(0, peer=1), Backward(0)], _last(0)]))


def test_bad_schedule_parameters_are_refused_with_the_fix():
    with pytest.raises(pp.ScheduleConfigError, match="M >= P"):
        pp.OneFOneB(micro_batches=3, stages=4)
    with pytest.raises(pp.ScheduleConfigError, match="multiple of P"):
        pp.Interleaved1F1B(micro_batches=6, stages=4, virtual_stages=2)
    with pytest.raises(pp.ScheduleConfigError, match="Interleaved1F1B"):
        pp.OneFOneB(micro_batches=4, stages=2, virtual_stages=2)
    with pytest.raises(pp.ScheduleConfigError, match="unknown schedule"):
        pp.get_schedule("pipedream")


def _without(program, *dropped):
    return [i for i in program if i not in dropped]


def test_a_stage_that_skips_a_collective_is_refused():
    # stage 1 skips the tied-gradient reduction: stage 0 would wait in it forever
    prog0, prog1 = pp.OneFOneB(micro_batches=2, stages=2).programs()
    with pytest.raises(pp.ScheduleError, match=r"different collectives.*stage 0 at ReduceTied"):
        pp.check(_Handwritten([prog0, _without(prog1, ReduceTiedGrads())]))
    # stage 0 skips every collective and finishes: stage 1 waits at the first
    epilogue = (ReduceTiedGrads(), ReduceGrads(), OptimizerStep())
    with pytest.raises(
        pp.ScheduleError,
        match=r"deadlocks: stage 1 waits at ReduceTiedGrads.*\[0\] finished their program",
    ):
        pp.check(_Handwritten([_without(prog0, *epilogue), prog1]))


def test_a_forward_without_its_load_is_refused():
    prog0, prog1 = pp.OneFOneB(micro_batches=2, stages=2).programs()
    with pytest.raises(pp.ScheduleError, match=r"stage 0.*Forward.*without LoadMicroBatch\(1, 0\)"):
        pp.check(_Handwritten([_without(prog0, LoadMicroBatch(1)), prog1]))
    with pytest.raises(pp.ScheduleError, match=r"stage 1.*without LoadMicroBatch\(0, 0\)"):
        pp.check(_Handwritten([prog0, _without(prog1, LoadMicroBatch(0))]))
    with pytest.raises(pp.ScheduleError, match="second time"):
        pp.check(_Handwritten([[LoadMicroBatch(0), *prog0], prog1]))
