"""One agreement per batch: every rank of the pipe × data grid learns whether any rank failed.

The p2p abort protocol (Note [a header before every message] in `p2p.py`) stops the stages of
ONE pipeline: a stage that fails tells its neighbours, who stop waiting. It cannot reach the other
data-parallel replicas, which share no point-to-point link with the failed pipeline: they would
run on into the gradient all-reduce and wait there for a peer that never comes, until the process
group's timeout (minutes). This file closes that gap.

Note [every rank reaches the agreement]
    A rank that fails (an exception in a forward, a backward, a bad micro-batch, the data-parallel
    reduction...) does not raise at once. It tells its pipeline neighbours (p2p ABORT), skips the
    rest of its program, and still takes part in every collective left in the batch, in the same
    order as a healthy rank: the tied-gradient all-reduce and the data-parallel all-reduce with
    zero stand-ins of the same size, from the same call site, then the agreement below. Healthy
    ranks reach the same collectives by running their program; ranks stopped by an ABORT reach
    them from wherever they stopped. So every collective is met by all its ranks and nobody
    waits forever. Then every rank raises together: the failed rank its own exception, the others
    `PipelineAbortedError` naming the failed ranks, the phase they failed in and their grid
    coordinates. No rank steps its optimizer on a failed batch; gradients are cleared.

The agreement rides the collective the batch already had: the returned loss used to be averaged
by an all-reduce over `data` and sent to the pipeline by a broadcast over `pipe`; now both are
all-reduces of one float32 vector `[loss, code_0, ..., code_{n−1}]` (n = P·D ranks of the grid,
`code_r` written by rank r alone, 0 when it is fine), first over `pipe` then over `data`, which
sums it over the whole grid. Cost per batch: the same 2 calls (one when P or D is 1, none on a
single process), each of 4·(1 + P·D) bytes instead of 4 (68 bytes on a 4 × 4 grid). Training adds
one more such exchange of the codes alone after the optimizer step (2 calls of 4·(1 + P·D) bytes)
so that a rank whose `optimizer.step()` raises stops the others too instead of leaving them to
block in the next batch's first receive. The same loss, all-reduced, also gives every rank the
same answer to "is it finite?": a NaN or infinite loss raises `NonFiniteLossError` on every rank
before the step (parameters untouched, gradients cleared, the executor still usable).

A code is `1 + 2·phase + aborted`: `phase` indexes `PHASES`, `aborted` is 1 for a rank stopped
by a neighbour's ABORT (it did not fail itself). Float32 holds these small integers exactly.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch

import minispeed.comm as comm
from minispeed.pipeline import instructions as ins
from minispeed.pipeline.p2p import PipelineAbortedError

__all__ = [
    "PHASES",
    "PHASE_OF",
    "NonFiniteLossError",
    "agree",
    "agree_at_build",
    "agree_on_world",
    "describe",
    "raise_failure",
    "status_code",
]

PHASES = ("start", "load", "forward", "backward", "send", "recv", "tied", "dp", "step")
"""Where a rank can fail in a batch: the checks before its program (`start`: e.g. no optimizer),
its program's instructions, the two reductions, the step."""

PHASE_OF: dict[type, str] = {
    ins.LoadMicroBatch: "load",
    ins.Forward: "forward",
    ins.Backward: "backward",
    ins.BackwardInput: "backward",
    ins.BackwardWeight: "backward",
    ins.SendActivation: "send",
    ins.SendGrad: "send",
    ins.RecvActivation: "recv",
    ins.RecvGrad: "recv",
    ins.ReduceTiedGrads: "tied",
    ins.ReduceGrads: "dp",
    ins.OptimizerStep: "step",
}
"""The phase each instruction class runs in."""

PROGRAM_PHASES = frozenset(PHASES[:6])
"""Failures here may leave point-to-point messages unread (see `PipelineExecutor`)."""


class NonFiniteLossError(FloatingPointError):
    """The batch's loss is NaN or infinite; raised on every rank, before the optimizer step."""


def status_code(phase: str, exc: BaseException) -> int:
    """The code a failed rank reports (see the module docstring)."""
    return 1 + 2 * PHASES.index(phase) + int(isinstance(exc, PipelineAbortedError))


def decode(code: int) -> tuple[str, bool]:
    """(phase, stopped by a neighbour) of a non-zero code."""
    return PHASES[(code - 1) // 2], bool((code - 1) % 2)


def agree(
    grid: Any, slot: int, value: torch.Tensor, code: int, device: torch.device
) -> tuple[torch.Tensor, list[int]]:
    """Sum `[value, codes...]` over the pipe × data plane of `grid`; every rank of the plane must
    call it, in the same order. Returns (the summed value, every rank's code by slot
    `stage · D + data`). Two all-reduces of 4·(1 + P·D) bytes (fewer when an axis has size 1)."""
    pipes, datas = grid.size("pipe"), grid.size("data")
    buf = torch.zeros(1 + pipes * datas, dtype=torch.float32, device=device)
    buf[0] = value.detach().reshape(())
    buf[1 + slot] = code
    for axis, size in (("pipe", pipes), ("data", datas)):
        if size > 1:
            comm.all_reduce(buf, group=grid.group(axis))
    codes = [int(c) for c in buf[1:].tolist()]
    return buf[0], codes


def describe(grid: Any, codes: list[int]) -> str:
    """The failed ranks, as a sentence: `stage 0 of replica 1 (global rank 1) failed in forward`.
    Ranks stopped by a neighbour are left out when some rank failed on its own."""
    own = [(s, c) for s, c in enumerate(codes) if c and not decode(c)[1]]
    shown = own or [(s, c) for s, c in enumerate(codes) if c]
    parts = []
    for slot, code in shown:
        phase, stopped = decode(code)
        what = "was stopped by a neighbour" if stopped else "failed"
        parts.append(f"{slot_name(grid, slot)} {what} in {phase}")
    return "; ".join(parts)


def slot_name(grid: Any, slot: int) -> str:
    """`pipeline stage 1 of data-parallel replica 0 (global rank 2)` for slot `stage · D + data`."""
    stage, data = divmod(slot, grid.size("data"))
    coord = dict(grid.coord)
    coord.update(pipe=stage, data=data)
    rank = grid.ranks[grid.topology.get_rank(**coord)]
    return f"pipeline stage {stage} of data-parallel replica {data} (global rank {rank})"


def agree_at_build(
    grid: Any, failure: Exception | None, fields: dict[str, float], what: str
) -> None:
    """Before the first collective of `what` (building a stage, an executor), every rank of the
    pipe × data plane learns whether any rank's local checks failed and whether all ranks chose
    the same `fields` (small integers: micro-batch count, schedule, layer cut...): if not, every
    rank raises, never one rank alone while its peers wait in a receive or a collective.

    A rank whose check failed raises its own error, the others `PipelineAbortedError` naming it;
    fields that differ raise `ValueError` on every rank naming each rank's value. Cost, once:
    2 all-reduces (over `pipe`, then `data`) of 8 · P · D · (1 + len(fields)) bytes."""
    pipes, datas = grid.size("pipe"), grid.size("data")
    slot = grid.rank_in("pipe") * datas + grid.rank_in("data")
    groups = [grid.group(axis) for axis in ("pipe", "data") if grid.size(axis) > 1]
    rows = _exchange(pipes * datas, slot, groups, failure, fields, grid.group("pipe"))
    _raise_on(rows, slot, failure, fields, what, lambda s: slot_name(grid, s))


def agree_on_world(failure: Exception | None, fields: dict[str, float], what: str) -> None:
    """`agree_at_build` over the whole world, for the checks made before a grid exists
    (`pipeline.partition`'s own arguments). Cost, once: 1 all-reduce of 8 · W · (1 + len(fields))
    bytes (none on one process)."""
    world, me = comm.get_world_size(), comm.get_rank()
    groups = [None] if world > 1 else []
    rows = _exchange(world, me, groups, failure, fields, None)
    _raise_on(rows, me, failure, fields, what, lambda r: f"global rank {r}")


def _exchange(
    n: int,
    slot: int,
    groups: list[Any],
    failure: Exception | None,
    fields: dict[str, float],
    device_group: Any,
) -> list[list[float]]:
    """Every rank's row `[failed, *fields]`: each writes its own row of an n-row zero matrix and
    the all-reduces (sums) over `groups` fill in the others."""
    buf = torch.zeros(n, 1 + len(fields), dtype=torch.float64)
    buf[slot, 0] = 0.0 if failure is None else 1.0
    buf[slot, 1:] = torch.tensor([float(v) for v in fields.values()], dtype=torch.float64)
    if groups:
        buf = buf.to(comm.tensor_device(device_group))
        for group in groups:
            comm.all_reduce(buf, group=group)
    return buf.cpu().tolist()


def _raise_on(
    rows: list[list[float]],
    me: int,
    failure: Exception | None,
    fields: dict[str, float],
    what: str,
    name: Any,
) -> None:
    if failure is not None:
        raise failure
    failed = [name(s) for s, row in enumerate(rows) if row[0]]
    if failed:
        raise PipelineAbortedError(
            f"{'; '.join(failed)} failed while {what} (see its error there); {name(me)} stopped "
            "with it instead of waiting for it"
        )
    for j, field in enumerate(fields, start=1):
        values = {s: row[j] for s, row in enumerate(rows)}
        if len(set(values.values())) > 1:
            listed = ", ".join(f"{name(s)}: {v:g}" for s, v in values.items())
            raise ValueError(
                f"the ranks disagree on {field} while {what} ({listed}); every rank of the "
                "pipeline must pass the same arguments"
            )


def raise_failure(
    grid: Any, failure: tuple[str, Exception] | None, codes: list[int], what: str
) -> NoReturn:
    """Raise on this rank after a failed agreement: its own error if it failed itself, else
    `PipelineAbortedError` naming the ranks that failed (chained to the ABORT it received, if
    any); `what` says what became of the batch."""
    if failure is not None and not isinstance(failure[1], PipelineAbortedError):
        raise failure[1]
    err = PipelineAbortedError(
        f"{describe(grid, codes)} (see its error there); pipeline stage {grid.rank_in('pipe')} of "
        f"replica {grid.rank_in('data')} stopped with it, {what}"
    )
    if failure is not None:
        raise err from failure[1]
    raise err
