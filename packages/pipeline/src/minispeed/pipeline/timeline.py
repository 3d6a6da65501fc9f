"""What one stage did during one batch, as intervals of compute and of waiting.

The executor records a `compute` interval around every forward / backward pass and a `wait`
interval around every receive (the time blocked on the previous or next stage). Everything else
(loading micro-batches, posting sends, reductions, the optimizer step) is neither.

The measured bubble of a stage is 1 − busy / span, span running from the start of the batch to
the end of the stage's last compute; `bubble_fraction` of a whole pipeline is 1 − Σ busy / Σ span
over its stages, the measured counterpart of `costs.bubble_fraction`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Interval", "StageTimeline", "pipeline_bubble"]


@dataclass(frozen=True)
class Interval:
    """One recorded interval, seconds since the batch started."""

    kind: str
    """`"compute"` or `"wait"`."""
    label: str
    """The instruction's label (`F3`, `B3`, `ra3` ...)."""
    start: float
    end: float


@dataclass
class StageTimeline:
    """The intervals of one stage in one batch."""

    stage: int
    t0: float = field(default_factory=time.perf_counter)
    intervals: list[Interval] = field(default_factory=list)

    def add(self, kind: str, label: str, start: float, end: float) -> None:
        """Record an interval given in `time.perf_counter()` seconds."""
        self.intervals.append(Interval(kind, label, start - self.t0, end - self.t0))

    def busy_s(self) -> float:
        """Seconds of compute."""
        return sum(i.end - i.start for i in self.intervals if i.kind == "compute")

    def forward_s(self) -> float:
        """Seconds of forward compute (the `F` passes; the rest of `busy_s` is backward)."""
        return sum(
            i.end - i.start for i in self.intervals if i.kind == "compute" and i.label[0] == "F"
        )

    def wait_s(self) -> float:
        """Seconds blocked in receives."""
        return sum(i.end - i.start for i in self.intervals if i.kind == "wait")

    def span_s(self) -> float:
        """From the batch start to the end of the last compute."""
        return max((i.end for i in self.intervals if i.kind == "compute"), default=0.0)

    def bubble(self) -> float:
        """1 − busy / span for this stage."""
        span = self.span_s()
        return 1.0 - self.busy_s() / span if span > 0 else 0.0

    def as_rows(self) -> list[tuple[str, str, float, float]]:
        """Plain tuples (kind, label, start, end): picklable, for tests and benchmarks."""
        return [(i.kind, i.label, i.start, i.end) for i in self.intervals]


def pipeline_bubble(busy_and_span: list[tuple[float, float]]) -> float:
    """1 − Σ busy / (P · max span) over the P stages' (busy_s, span_s): the idle share of the
    pipeline's step, comparable with `costs.bubble_fraction`."""
    span = max(s for _, s in busy_and_span)
    return 1.0 - sum(b for b, _ in busy_and_span) / (span * len(busy_and_span))
