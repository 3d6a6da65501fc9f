"""Prove a schedule safe before running it: simulate every stage, match every send to its receive.

`check(schedule)` runs all stages' programs together on a model of the executor:

- a send never waits (the executor posts it asynchronously); it appends its message to the FIFO
  channel (sender → receiver);
- a receive waits until its channel holds a message, and that message must be exactly the one
  it expects (same micro-batch, same kind, the chunk that follows or precedes it): messages between
  two ranks arrive in the order they were sent, so "in order" is the only order that works;
- compute takes `cost[kind]` time units (forward 1, full backward 2, each backward half 1, by
  default);
- a collective (`ReduceTiedGrads`, `ReduceGrads`, and the agreement before `OptimizerStep`)
  waits until every stage reaches a collective, and all of them must be the same one: it is
  modelled as a barrier of all stages, which is stricter than the executor needs where the real
  group is smaller (the holders of a tie, the data-parallel replicas of one stage), so the
  checker may refuse a schedule that would run, never accept one that hangs;
- a `LoadMicroBatch` must come before the `Forward` of the same micro-batch and chunk, exactly
  once, on the first and the last virtual stage (inputs there, labels here).

It raises `ScheduleError` when a receive meets the wrong message, when every unfinished stage
waits on a receive nobody will send or on a collective a stage skips (a deadlock, with each
stage's blocked instruction named), when stages meet at different collectives, when a message is
never received, when a forward runs without its load, or when a stage's passes are out of order
(a backward before its forward, a micro-batch run twice or never). On success it returns a `Simulation`: each
stage's compute intervals, from which `printer.py` draws the time × stage table and `costs.py`'s
bubble formula is checked.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minispeed.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from minispeed.pipeline.schedules import PipeSchedule

__all__ = ["DEFAULT_COSTS", "ScheduleError", "Simulation", "check"]

DEFAULT_COSTS: dict[type, float] = {
    Forward: 1.0,
    Backward: 2.0,
    BackwardInput: 1.0,
    BackwardWeight: 1.0,
}
"""Time units per compute instruction: backward ≈ 2× forward, each zero-bubble half ≈ 1×."""


COLLECTIVES = (ReduceTiedGrads, ReduceGrads, OptimizerStep)
"""Instructions every stage joins (modelled as barriers of all stages)."""


class ScheduleError(RuntimeError):
    """The schedule would deadlock, mismatch a message, or run a pass out of order."""


@dataclass
class Simulation:
    """What `check` found: per stage, the compute intervals `(start, end, instruction)`."""

    schedule: PipeSchedule
    intervals: list[list[tuple[float, float, Instruction]]]
    peak_in_flight: list[int] = field(default_factory=list)
    """Per stage: most micro-batch chunks forwarded and not yet freed at once (activations kept)."""

    @property
    def makespan(self) -> float:
        """Time from the first compute to the last, over all stages."""
        return max((iv[-1][1] for iv in self.intervals if iv), default=0.0)

    def bubble_fraction(self) -> float:
        """Idle share of P · makespan: 1 − Σ busy / (P · makespan)."""
        busy = sum(e - s for iv in self.intervals for s, e, _ in iv)
        span = self.makespan * len(self.intervals)
        return 1.0 - busy / span if span else 0.0


def check(schedule: PipeSchedule, costs: dict[type, float] | None = None) -> Simulation:
    """Simulate all stages of `schedule`; raise `ScheduleError` or return the `Simulation`."""
    cost = {**DEFAULT_COSTS, **(costs or {})}
    p = schedule.stages
    programs = schedule.programs()
    pc = [0] * p  # next instruction per stage
    clock = [0.0] * p
    channels: dict[tuple[int, int], deque[tuple[str, int, int, float]]] = {}
    intervals: list[list[tuple[float, float, Instruction]]] = [[] for _ in range(p)]
    state: list[dict[tuple[int, int], str]] = [{} for _ in range(p)]  # (mb, chunk) -> last pass
    live = [0] * p
    peak = [0] * p
    loaded: list[set[tuple[int, int]]] = [set() for _ in range(p)]
    last_virtual = schedule.num_virtual - 1

    def needs_load(s: int, chunk: int) -> bool:
        v = chunk * p + s
        return v == 0 or v == last_virtual

    def run_load(s: int, instr: LoadMicroBatch) -> None:
        key = (instr.micro_batch, instr.chunk)
        if key in loaded[s]:
            raise fail(s, instr, "loads this micro-batch a second time")
        if state[s].get(key) is not None:
            raise fail(s, instr, f"runs after {state[s][key]}; the load must come before Forward")
        loaded[s].add(key)

    def fail(stage: int, instr: Instruction, why: str) -> ScheduleError:
        return ScheduleError(f"{schedule!r}: stage {stage}, instruction {instr!r}: {why}")

    def run_compute(s: int, instr: Instruction) -> None:
        key = (instr.micro_batch, instr.chunk)  # type: ignore[attr-defined]
        before = state[s].get(key)
        legal = {
            Forward: (None,),
            Backward: ("F",),
            BackwardInput: ("F",),
            BackwardWeight: ("b",),
        }[type(instr)]
        if before not in legal:
            raise fail(s, instr, f"runs after {before or 'nothing'}; it must follow {legal}")
        if isinstance(instr, Forward) and needs_load(s, instr.chunk) and key not in loaded[s]:
            raise fail(
                s,
                instr,
                f"runs without LoadMicroBatch({instr.micro_batch}, {instr.chunk}) before it: the "
                "first and the last virtual stage load each micro-batch (inputs there, labels "
                "here) before its forward",
            )
        state[s][key] = {Forward: "F", Backward: "B", BackwardInput: "b", BackwardWeight: "W"}[
            type(instr)
        ]
        if isinstance(instr, Forward) and schedule.trains:
            live[s] += 1
            peak[s] = max(peak[s], live[s])
        if isinstance(instr, (Backward, BackwardWeight)):
            live[s] -= 1
        start = clock[s]
        clock[s] = start + cost[type(instr)]
        intervals[s].append((start, clock[s], instr))

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pc[s] < len(programs[s]):
                instr = programs[s][pc[s]]
                if isinstance(instr, COLLECTIVES):
                    break  # joined below, once every stage is at one
                if isinstance(instr, (SendActivation, SendGrad)):
                    kind = "act" if isinstance(instr, SendActivation) else "grad"
                    channels.setdefault((s, instr.peer), deque()).append(
                        (kind, instr.micro_batch, instr.chunk, clock[s])
                    )
                elif isinstance(instr, (RecvActivation, RecvGrad)):
                    queue = channels.get((instr.peer, s))
                    if not queue:
                        break  # blocked: try the other stages
                    kind, mb, chunk, sent_at = queue.popleft()
                    want = (
                        "act" if isinstance(instr, RecvActivation) else "grad",
                        instr.micro_batch,
                    )
                    if (kind, mb) != want or not _chunk_matches(schedule, instr, s, chunk):
                        raise fail(
                            s,
                            instr,
                            f"the next message from stage {instr.peer} is {kind} of micro-batch "
                            f"{mb} (chunk {chunk}), not the {want[0]} of micro-batch {want[1]}: "
                            "sends and receives between two stages must happen in the same order",
                        )
                    clock[s] = max(clock[s], sent_at)
                elif isinstance(instr, LoadMicroBatch):
                    run_load(s, instr)
                elif isinstance(instr, (Forward, Backward, BackwardInput, BackwardWeight)):
                    run_compute(s, instr)
                pc[s] += 1
                progress = True
        if not progress and all(
            pc[s] < len(programs[s]) and isinstance(programs[s][pc[s]], COLLECTIVES)
            for s in range(p)
        ):
            at = [programs[s][pc[s]] for s in range(p)]
            if len({type(i) for i in at}) > 1:
                lines = "; ".join(f"stage {s} at {i!r}" for s, i in enumerate(at))
                raise ScheduleError(
                    f"{schedule!r}: the stages meet at different collectives ({lines}); every "
                    "stage must issue the same collectives in the same order"
                )
            meet = max(clock)
            for s in range(p):
                clock[s], pc[s] = meet, pc[s] + 1
            progress = True
    stuck = [s for s in range(p) if pc[s] < len(programs[s])]
    if stuck:
        lines = "; ".join(f"stage {s} waits at {programs[s][pc[s]]!r}" for s in stuck)
        done = [s for s in range(p) if pc[s] == len(programs[s])]
        if done:
            lines += f"; stage(s) {done} finished their program without joining it"
        raise ScheduleError(f"{schedule!r} deadlocks: {lines}")
    leftover = {k: list(q) for k, q in channels.items() if q}
    if leftover:
        raise ScheduleError(f"{schedule!r}: messages sent and never received: {leftover}")
    for s in range(p):
        want = {"W"} if schedule.splits_backward else {"B"} if schedule.trains else {"F"}
        for mb in range(schedule.micro_batches):
            for c in range(schedule.virtual_stages):
                if state[s].get((mb, c)) not in want:
                    raise ScheduleError(
                        f"{schedule!r}: stage {s} leaves micro-batch {mb} chunk {c} at "
                        f"{state[s].get((mb, c)) or 'never run'}; expected it to end at {want}"
                    )
    return Simulation(schedule, intervals, peak)


def _chunk_matches(
    schedule: PipeSchedule, instr: Instruction, receiver: int, sent_chunk: int
) -> bool:
    """Whether a message sent from chunk `sent_chunk` feeds the receiver's chunk."""
    p = schedule.stages
    mine = instr.chunk  # type: ignore[attr-defined]
    v_recv = mine * p + receiver
    if isinstance(instr, RecvActivation):
        sender = (receiver - 1) % p
        return sent_chunk * p + sender == v_recv - 1
    sender = (receiver + 1) % p
    return sent_chunk * p + sender == v_recv + 1
