"""Pipeline schedules as data: for each stage, the ordered list of instructions it runs per batch.

Read them in this order, each one a small answer to the bubble of the one before
(P stages, M micro-batches, V model chunks per stage; see `costs.bubble_fraction`):

| schedule | order on one stage | bubble fraction | activations kept (micro-batches) |
|---|---|---|---|
| `GPipe` | all M forwards, then all M backwards | (P−1)/(M+P−1) | M |
| `OneFOneB` | P−1−s forwards, then one forward / one backward, then the rest | (P−1)/(M+P−1) | ≤ P − s |
| `Interleaved1F1B` | 1F1B over V chunks, in rounds of P micro-batches | (P−1)/(V·M+P−1) | ≤ 2(P−1−s) + (V−1)·P + 1 chunk passes of 1/V each |
| `ZeroBubbleH1` | 1F1B with backward split in input (b) and weight (W) passes, W's held back into the drain | (P−1)/(3M+P−1) for F = b = W | ≤ P (F to W) |
| `InferenceSchedule` | forwards only | (P−1)/(M+P−1) | 0 |

Every schedule is built from two blocks per micro-batch and chunk (`_forward_block`,
`_backward_block`): the receive that feeds the compute, the compute, the send that follows it.
Sends do not wait for their receiver (the executor posts them asynchronously); receives do.
`checker.check` proves on these lists, before anything runs, that every receive meets its send
in order and that no stage waits forever.
"""

from __future__ import annotations

from collections import deque

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

__all__ = [
    "SCHEDULES",
    "GPipe",
    "InferenceSchedule",
    "Interleaved1F1B",
    "OneFOneB",
    "PipeSchedule",
    "ScheduleConfigError",
    "ZeroBubbleH1",
    "get_schedule",
]


class ScheduleConfigError(ValueError):
    """A schedule cannot be built for these (M, P, V): the message names the fix."""


class PipeSchedule:
    """Base class: `programs()` gives every stage's instruction list for one batch.

    Subclasses implement `_compute_order(stage)`: the order of forward / backward passes on one
    stage as `("F" | "B" | "b" | "W", micro_batch, chunk)`; communication, loads and the epilogue
    are added here, the same way for every schedule.
    """

    name = "base"
    trains = True
    """False for schedules that only run forwards (no backward, no optimizer step)."""
    splits_backward = False
    """True when backward is split into `BackwardInput` and `BackwardWeight`."""

    def __init__(self, micro_batches: int, stages: int, virtual_stages: int = 1) -> None:
        for what, v in (("micro_batches", micro_batches), ("stages", stages)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ScheduleConfigError(f"{self.name}: {what} must be an int >= 1, got {v!r}")
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
            raise ScheduleConfigError(
                f"{self.name}: virtual_stages must be an int, got {virtual_stages!r}"
            )
        if virtual_stages != 1 and not isinstance(self, (Interleaved1F1B, InferenceSchedule)):
            raise ScheduleConfigError(
                f"{self.name} runs one chunk per stage, got virtual_stages={virtual_stages}; "
                "use Interleaved1F1B for several chunks per stage"
            )
        self.micro_batches, self.stages, self.virtual_stages = micro_batches, stages, virtual_stages
        self._validate()

    def _validate(self) -> None:
        """Schedule-specific checks on (M, P, V); raise ScheduleConfigError naming the fix."""

    @property
    def num_virtual(self) -> int:
        """Virtual stages in the pipeline: P · V."""
        return self.stages * self.virtual_stages

    # -- the shared blocks ------------------------------------------------------------------------
    def _virtual(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def _forward_block(self, stage: int, mb: int, chunk: int) -> list[Instruction]:
        v, last = self._virtual(stage, chunk), self.num_virtual - 1
        out: list[Instruction] = []
        if v == 0 or v == last:
            out.append(LoadMicroBatch(mb, chunk))
        if v > 0:
            out.append(RecvActivation(mb, chunk, peer=(stage - 1) % self.stages))
        out.append(Forward(mb, chunk))
        if v < last:
            out.append(SendActivation(mb, chunk, peer=(stage + 1) % self.stages))
        return out

    def _backward_block(self, stage: int, mb: int, chunk: int, kind: type) -> list[Instruction]:
        v, last = self._virtual(stage, chunk), self.num_virtual - 1
        out: list[Instruction] = []
        if v < last:
            out.append(RecvGrad(mb, chunk, peer=(stage + 1) % self.stages))
        out.append(kind(mb, chunk))
        if v > 0:
            out.append(SendGrad(mb, chunk, peer=(stage - 1) % self.stages))
        return out

    def _compute_order(self, stage: int) -> list[tuple[str, int, int]]:
        raise NotImplementedError

    def program(self, stage: int) -> list[Instruction]:
        """Instructions of `stage` for one batch, in the order it runs them."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} outside [0, {self.stages})")
        out: list[Instruction] = []
        for kind, mb, chunk in self._compute_order(stage):
            if kind == "F":
                out += self._forward_block(stage, mb, chunk)
            elif kind == "B":
                out += self._backward_block(stage, mb, chunk, Backward)
            elif kind == "b":
                out += self._backward_block(stage, mb, chunk, BackwardInput)
            else:
                out.append(BackwardWeight(mb, chunk))
        if self.trains:
            out += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
        return out

    def programs(self) -> list[list[Instruction]]:
        """`program(s)` for every stage s."""
        return [self.program(s) for s in range(self.stages)]

    def __repr__(self) -> str:
        v = f", virtual_stages={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"{type(self).__name__}(micro_batches={self.micro_batches}, stages={self.stages}{v})"


class GPipe(PipeSchedule):
    """All forwards, then all backwards (Huang et al., 2019). The naive schedule: simplest to
    read, same bubble as 1F1B, but stage s keeps the activations of all M micro-batches."""

    name = "gpipe"

    def _compute_order(self, stage: int) -> list[tuple[str, int, int]]:
        m = self.micro_batches
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


class OneFOneB(PipeSchedule):
    """One forward, one backward (PipeDream-flush, Narayanan et al., 2021; DeepSpeed's
    TrainSchedule). Stage s runs P−1−s warm-up forwards, then alternates, then drains: at most
    P − s micro-batches are in flight on stage s, whatever M is."""

    name = "1f1b"

    def _validate(self) -> None:
        if self.micro_batches < self.stages:
            raise ScheduleConfigError(
                f"1F1B needs at least as many micro-batches as stages (M >= P) to reach its steady "
                f"state; got M={self.micro_batches} < P={self.stages}. Raise the micro-batch count "
                "(gradient_accumulation_steps) to >= P, or use GPipe"
            )

    def _warmup(self, stage: int) -> int:
        return min(self.stages - 1 - stage, self.micro_batches)

    def _compute_order(self, stage: int) -> list[tuple[str, int, int]]:
        m, w = self.micro_batches, self._warmup(stage)
        order = [("F", i, 0) for i in range(w)]
        for i in range(m - w):
            order += [("F", w + i, 0), ("B", i, 0)]
        order += [("B", i, 0) for i in range(m - w, m)]
        return order


class Interleaved1F1B(OneFOneB):
    """1F1B over V model chunks per stage (Narayanan et al., 2021, Megatron-LM): rank s holds
    virtual stages s, s+P, ..., so a micro-batch crosses the ranks V times, each time doing 1/V
    of the work; the fill and drain shrink V-fold: bubble (P−1)/(V·M+P−1). Costs V× more
    point-to-point messages. Micro-batches run in rounds of P, so M must be a multiple of P."""

    name = "interleaved_1f1b"

    def _validate(self) -> None:
        super()._validate()
        if self.virtual_stages < 2:
            raise ScheduleConfigError(
                f"Interleaved1F1B needs virtual_stages >= 2, got {self.virtual_stages}; use "
                "OneFOneB for one chunk per stage"
            )
        if self.micro_batches % self.stages:
            raise ScheduleConfigError(
                f"Interleaved1F1B runs micro-batches in rounds of P: M={self.micro_batches} is not "
                f"a multiple of P={self.stages}; use M = {self.stages}·k"
            )

    def _ids(self, k: int, backward: bool) -> tuple[int, int]:
        p, v = self.stages, self.virtual_stages
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return mb, (v - 1 - chunk if backward else chunk)

    def _compute_order(self, stage: int) -> list[tuple[str, int, int]]:
        p, v, m = self.stages, self.virtual_stages, self.micro_batches
        total = m * v
        w = min((p - 1 - stage) * 2 + (v - 1) * p, total)
        order = [("F", *self._ids(k, False)) for k in range(w)]
        for i in range(total - w):
            order += [("F", *self._ids(w + i, False)), ("B", *self._ids(i, True))]
        order += [("B", *self._ids(k, True)) for k in range(total - w, total)]
        return order


class ZeroBubbleH1(OneFOneB):
    """1F1B with backward split in two (Qi et al., 2024, "Zero Bubble Pipeline Parallelism",
    schedule ZB-H1). The input-gradient pass `b` (what the previous stage waits for) runs where
    1F1B runs B and is sent at once; the weight-gradient pass `W` (which nobody waits for) is
    held back: stage s keeps up to s W's pending in the steady state, so the steady state runs at
    the pace of F + b on the stages the drain will wait for, and then runs one held W after each
    b of the drain, in the gaps where 1F1B idles.

    With F = b = W the bubble is (P−1)/(3M+P−1), a third of 1F1B's (P−1)·3/(3M+P−1)
    (`costs.zero_bubble_fraction`). Memory: a micro-batch is "in flight" from its F to its W;
    every stage peaks at P, which is 1F1B's peak (on its stage 0), so no stage needs more than
    the 1F1B pipeline as a whole.
    """

    name = "zb_h1"
    splits_backward = True

    def _compute_order(self, stage: int) -> list[tuple[str, int, int]]:
        m, w = self.micro_batches, self._warmup(stage)
        hold = stage  # W's held back on stage s: see the class docstring
        pending: deque[int] = deque()
        order: list[tuple[str, int, int]] = [("F", i, 0) for i in range(w)]
        for i in range(m - w):
            order += [("F", w + i, 0), ("b", i, 0)]
            pending.append(i)
            while len(pending) > hold:
                order.append(("W", pending.popleft(), 0))
        for i in range(m - w, m):  # the drain: one W into the gap after each b
            order.append(("b", i, 0))
            pending.append(i)
            order.append(("W", pending.popleft(), 0))
        order += [("W", i, 0) for i in pending]
        return order


class InferenceSchedule(PipeSchedule):
    """Forwards only, in micro-batch order (chunk by chunk when V > 1): for `eval_batch()`.
    No backward, no step."""

    name = "inference"
    trains = False

    def _compute_order(self, stage: int) -> list[tuple[str, int, int]]:
        v, m = self.virtual_stages, self.micro_batches
        return [("F", i, c) for c in range(v) for i in range(m)]


SCHEDULES: dict[str, type[PipeSchedule]] = {
    cls.name: cls for cls in (GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1, InferenceSchedule)
}
"""Schedules by name (`"gpipe"`, `"1f1b"`, `"interleaved_1f1b"`, `"zb_h1"`, `"inference"`)."""


def get_schedule(name: str | type[PipeSchedule]) -> type[PipeSchedule]:
    """The schedule class for `name` (a key of `SCHEDULES`, or a class, returned as is)."""
    if isinstance(name, type) and issubclass(name, PipeSchedule):
        return name
    if name not in SCHEDULES:
        raise ScheduleConfigError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]
