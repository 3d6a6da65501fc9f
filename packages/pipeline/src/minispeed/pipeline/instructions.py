"""The instruction set of a pipeline schedule: what one stage does, one step at a time.

A schedule (see `schedules.py`) is a list of these per stage; the executor (`executor.py`) maps
each class to one method. Instructions are plain frozen dataclasses so a schedule can be printed,
compared with a table written by hand, and checked (`checker.py`) before anything runs.

Fields shared by the per-micro-batch instructions:

- `micro_batch`: index m in [0, M) of the micro-batch;
- `chunk`: which of this stage's model chunks (0 unless the schedule is interleaved, where rank s
  holds virtual stages s, s + P, s + 2P, ...: chunk c is virtual stage c·P + s);
- `peer` (communication only): the pipeline rank on the other side.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Backward",
    "BackwardInput",
    "BackwardWeight",
    "Forward",
    "Instruction",
    "LoadMicroBatch",
    "OptimizerStep",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
]


@dataclass(frozen=True)
class Instruction:
    """Base class; `label` is the short name the printer draws."""

    @property
    def label(self) -> str:
        """Short name for tables, e.g. `F3` (forward of micro-batch 3) or `F3.1` (chunk 1)."""
        return type(self).__name__


@dataclass(frozen=True)
class _PerMicroBatch(Instruction):
    micro_batch: int
    """Micro-batch index m in [0, M)."""
    chunk: int = 0
    """Model chunk on this stage (virtual stage chunk·P + stage)."""

    _LETTER = "?"

    @property
    def label(self) -> str:
        suffix = f".{self.chunk}" if self.chunk else ""
        return f"{self._LETTER}{self.micro_batch}{suffix}"


@dataclass(frozen=True)
class _Message(_PerMicroBatch):
    peer: int = 0
    """Pipeline rank on the other side of the message."""


@dataclass(frozen=True)
class LoadMicroBatch(_PerMicroBatch):
    """Take micro-batch m from the batch: its inputs on the first virtual stage, its labels on the
    last (both on a one-stage pipeline)."""

    _LETTER = "L"


@dataclass(frozen=True)
class Forward(_PerMicroBatch):
    """Run this chunk's layers on micro-batch m; keep what backward needs (the activations).
    On the last virtual stage also compute the loss. Cost: the chunk's forward FLOPs."""

    _LETTER = "F"


@dataclass(frozen=True)
class Backward(_PerMicroBatch):
    """Back-propagate micro-batch m through this chunk: gradients of its input AND of its
    weights (accumulated in `.grad`), then free its activations. Cost ≈ 2× the forward."""

    _LETTER = "B"


@dataclass(frozen=True)
class BackwardInput(_PerMicroBatch):
    """Zero-bubble half of Backward: only the gradient of the chunk's input (what the previous
    stage waits for), keeping what the weight pass needs. Cost ≈ the forward."""

    _LETTER = "b"


@dataclass(frozen=True)
class BackwardWeight(_PerMicroBatch):
    """Zero-bubble other half: the weight gradients of micro-batch m, from the gradients the
    input pass left; then free its activations. Cost ≈ the forward. Nobody waits for it, so a
    schedule can move it into a bubble."""

    _LETTER = "W"


@dataclass(frozen=True)
class SendActivation(_Message):
    """Send this chunk's output for micro-batch m to `peer` (the next virtual stage)."""

    _LETTER = "sa"


@dataclass(frozen=True)
class RecvActivation(_Message):
    """Receive this chunk's input for micro-batch m from `peer` (the previous virtual stage)."""

    _LETTER = "ra"


@dataclass(frozen=True)
class SendGrad(_Message):
    """Send the gradient of this chunk's input for micro-batch m to `peer` (previous stage)."""

    _LETTER = "sg"


@dataclass(frozen=True)
class RecvGrad(_Message):
    """Receive the gradient of this chunk's output for micro-batch m from `peer` (next stage)."""

    _LETTER = "rg"


@dataclass(frozen=True)
class ReduceTiedGrads(Instruction):
    """Sum the gradients of tied layers over the stages that hold a copy (all-reduce in the tie
    group): each copy then holds the gradient the unsplit model's single weight would have.
    Bytes sent per tied weight of W bytes: 2(t−1)/t · W over t holders."""

    @property
    def label(self) -> str:
        return "tied"


@dataclass(frozen=True)
class ReduceGrads(Instruction):
    """Average gradients over the data-parallel group (all-reduce; 2(N−1)/N · stage bytes)."""

    @property
    def label(self) -> str:
        return "dp"


@dataclass(frozen=True)
class OptimizerStep(Instruction):
    """Step this stage's optimizer and zero its gradients."""

    @property
    def label(self) -> str:
        return "step"
