"""Schedules are data: exact instruction tables written by hand, and the simulated time table."""

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

EPILOGUE = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def test_1f1b_two_stages_three_micro_batches_instruction_table():
    s = pp.OneFOneB(micro_batches=3, stages=2)
    # stage 0: one warm-up forward, then forward/backward pairs, then the drain
    assert s.program(0) == [
        LoadMicroBatch(0), Forward(0), SendActivation(0, peer=1),
        LoadMicroBatch(1), Forward(1), SendActivation(1, peer=1),
        RecvGrad(0, peer=1), Backward(0),
        LoadMicroBatch(2), Forward(2), SendActivation(2, peer=1),
        RecvGrad(1, peer=1), Backward(1),
        RecvGrad(2, peer=1), Backward(2),
        *EPILOGUE,
    ]  # fmt: skip
    # stage 1 (last): no warm-up; loads labels, computes the loss, sends input gradients back
    assert s.program(1) == [
        x
        for m in range(3)
        for x in (LoadMicroBatch(m), RecvActivation(m, peer=0), Forward(m), Backward(m), SendGrad(m, peer=0))
    ] + EPILOGUE  # fmt: skip


def test_gpipe_and_1f1b_time_tables_match_the_hand_drawn_ones():
    # forward 1 unit, backward 2: "" is a bubble
    gpipe = pp.schedule_grid(pp.check(pp.GPipe(micro_batches=2, stages=2)))
    assert gpipe == [
        ["F0", "F1", "", "", "", "B0", "B0", "B1", "B1"],
        ["", "F0", "F1", "B0", "B0", "B1", "B1", "", ""],
    ]
    one = pp.schedule_grid(pp.check(pp.OneFOneB(micro_batches=3, stages=2)))
    assert one == [
        ["F0", "F1", "", "", "B0", "B0", "F2", "B1", "B1", "", "B2", "B2"],
        ["", "F0", "B0", "B0", "F1", "B1", "B1", "F2", "B2", "B2", "", ""],
    ]


def test_interleaved_rounds_of_p_micro_batches_over_chunks():
    s = pp.Interleaved1F1B(micro_batches=2, stages=2, virtual_stages=2)
    computes = [(type(i).__name__[0], i.micro_batch, i.chunk) for i in s.program(0)
                if isinstance(i, (Forward, Backward))]  # fmt: skip
    # warm-up 2·(P−1−s) + (V−1)·P = 4 forwards: mb 0,1 of chunk 0 then of chunk 1; backwards
    # run the chunks in reverse
    assert computes == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
                        ("B", 0, 1), ("B", 1, 1), ("B", 0, 0), ("B", 1, 0)]  # fmt: skip
    # chunk 1 of stage 0 receives from stage 1 (the wrap from virtual stage 1 to 2)
    assert RecvActivation(0, 1, peer=1) in s.program(0)
    assert SendActivation(0, 0, peer=0) in s.program(1)


def test_zero_bubble_sends_the_input_gradient_first_and_holds_weight_passes_back():
    prog = pp.ZeroBubbleH1(micro_batches=2, stages=2).program(1)
    labels = [
        i.label for i in prog if not isinstance(i, (ReduceTiedGrads, ReduceGrads, OptimizerStep))
    ]
    # stage 1 holds one W back: W0 runs after b1, in the gap where stage 0 drains
    assert labels == ["L0", "ra0", "F0", "b0", "sg0", "L1", "ra1", "F1", "b1", "sg1", "W0", "W1"]
    prog0 = pp.ZeroBubbleH1(micro_batches=2, stages=2).program(0)
    assert [i.label for i in prog0 if isinstance(i, (pp.Forward, pp.BackwardInput, pp.BackwardWeight))] == [
        "F0", "F1", "b0", "W0", "b1", "W1"
    ]  # fmt: skip


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (4, 4), (4, 8), (4, 13)])
def test_simulated_bubble_equals_the_formula(p, m):
    for cls in (pp.GPipe, pp.OneFOneB, pp.InferenceSchedule):
        sim = pp.check(cls(micro_batches=m, stages=p))
        assert sim.bubble_fraction() == pytest.approx(pp.bubble_fraction(p, m))
    if m % p == 0:
        for v in (2, 3):
            sim = pp.check(pp.Interleaved1F1B(micro_batches=m, stages=p, virtual_stages=v))
            assert sim.bubble_fraction() == pytest.approx(pp.bubble_fraction(p, m, v))
            assert sim.bubble_fraction() < pp.bubble_fraction(p, m)
    for f, b, w in [(1, 1, 1), (2, 1, 1), (1, 1.5, 0.5)]:
        costs = {pp.Forward: f, pp.BackwardInput: b, pp.BackwardWeight: w}
        zb = pp.check(pp.ZeroBubbleH1(micro_batches=m, stages=p), costs=costs)
        assert zb.bubble_fraction() == pytest.approx(pp.costs.zero_bubble_fraction(p, m, f, b, w))
    one = pp.check(pp.OneFOneB(micro_batches=m, stages=p), costs={pp.Backward: 2})
    zb = pp.check(pp.ZeroBubbleH1(micro_batches=m, stages=p))
    # a third of 1F1B's idle time when F = b = W
    idle = lambda sim: sim.bubble_fraction() * sim.makespan  # noqa: E731
    assert idle(zb) == pytest.approx(idle(one) / 3)


@pytest.mark.parametrize("p,m", [(2, 6), (4, 4), (4, 9)])
def test_simulated_in_flight_micro_batches_follow_the_bound(p, m):
    for cls in (pp.GPipe, pp.OneFOneB, pp.ZeroBubbleH1):
        sim = pp.check(cls(micro_batches=m, stages=p))
        assert sim.peak_in_flight == [pp.in_flight_bound(cls.name, s, p, m) for s in range(p)]


def test_printer_draws_every_schedule():
    text = pp.print_schedule(pp.OneFOneB(micro_batches=3, stages=2))
    assert "B2" in text and "bubble 25.0%" in text
    for s in (
        pp.GPipe(4, 2),
        pp.Interleaved1F1B(4, 2, 2),
        pp.ZeroBubbleH1(4, 2),
        pp.InferenceSchedule(4, 2),
    ):
        assert "F3" in pp.print_schedule(s)


def test_a_long_schedule_prints_every_label_whole_at_the_default_width():
    # 4 stages × 8 micro-batches × 2 chunks: 57 time units of labels up to 4 characters, which
    # rich used to shrink to "…" in every cell at width 200
    schedule = pp.Interleaved1F1B(micro_batches=8, stages=4, virtual_stages=2)
    text = pp.print_schedule(schedule)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 200
    cells = [line.split("│")[2:-1] for line in text.splitlines() if line.startswith("│")]
    printed = [c.strip() for row in cells for c in row]
    grid = pp.schedule_grid(pp.check(schedule))
    assert sorted(c or "·" for row in grid for c in row) == sorted(printed)
