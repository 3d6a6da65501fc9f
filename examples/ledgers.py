"""The demo's two ledgers: bytes each rank should hold and send, next to the bytes it did.

Both sides come from minispeed itself, never from this file:

- memory, predicted: ``minispeed.zero.memory``: the ZeRO paper's per-rank formula for the stage
  (``estimate``) and minispeed's own (``predict``: the paper plus the differences it names, e.g.
  no separate fp32 master when the parameters are fp32); measured: ``minispeed.zero.measure``
  (the bytes of the distinct storages the live optimizer and model hold), on every rank, after
  the last backward of step 2 and before its optimizer step (optimizer state and gradients both
  exist then). Measured must equal minispeed's formula up to padding.
- communication, predicted: ``minispeed.zero.ledger.stage_collectives`` (stages 0-2, from the
  strategy's actual bucket sizes) or ``minispeed.zero.stage3.stage3_step_bytes`` (stage 3), plus
  the per-step flag and norm all-reduces every stage issues; measured: the
  ``minispeed.comm.CommsLogger`` that recorded every collective of the training steps.

The comm ledger compares one steady-state optimizer step (every logged step but the first, whose
stage-3 forward records the fetch trace): the measured bytes per step must be the same on every
such step, and the table shows it with its min and max.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.comm import costs
from minispeed.zero import memory

__all__ = ["comm_ledger", "measure_memory", "memory_ledger", "predict_memory", "print_ledgers"]

_COLUMNS = ("params", "grads", "optimizer", "total")


def _bytes_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def predict_memory(
    model: nn.Module, zcfg: zero.ZeroConfig, precision: zero.MixedPrecision, ds: dict, world: int
) -> dict[str, int]:
    """The ZeRO paper's per-rank model-state bytes for this run (call before ``zero.shard``)."""
    optimizer_cls = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}[
        ds.get("optimizer", {}).get("type", "AdamW")
    ]
    threshold = zcfg.stage3_param_persistence_threshold_numel if zcfg.stage == 3 else None
    est = memory.estimate(
        model,
        world,
        stages=(zcfg.stage,),
        param_bytes=_bytes_of(precision.param_dtype),
        grad_bytes=_bytes_of(precision.grad_accum_dtype),
        optimizer_bytes=memory.optimizer_bytes_per_param(optimizer_cls),
        persistence_threshold_numel=threshold,
    )
    row = est.row(zcfg.stage)
    return {
        "params": row.params,
        "grads": row.grads,
        "optimizer": row.optimizer,
        "total": row.total,
    }


def measure_memory(opt: zero.ZeroOptimizer, model: nn.Module) -> dict[str, dict[str, int]]:
    """Between a boundary backward and its step: minispeed's own formula for this optimizer, this rank's measurement,
    and the most padding may add (``zero.memory.predict`` / ``measure`` / ``padding_allowance``)."""
    pred, got, pad = memory.predict(opt), memory.measure(opt, model), memory.padding_allowance(opt)
    return {
        "predicted": {c: int(getattr(pred, c)) for c in _COLUMNS},
        "measured": {
            "params": got.params,
            "grads": got.grads,
            "optimizer": got.optimizer,
            "total": got.params + got.grads + got.optimizer,
            "other": got.other,
        },
        "allowance": {c: int(getattr(pad, c)) for c in _COLUMNS},
    }


def memory_ledger(paper: dict[str, int], ours: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Rows: the paper's formula, minispeed's formula, each rank's measurement (collective)."""
    everyone = comm.all_gather_object(ours)
    rows: list[dict[str, Any]] = [
        {"who": "ZeRO paper formula", **paper},
        {
            "who": "minispeed formula",
            **everyone[0]["predicted"],
            "allowance": everyone[0]["allowance"],
        },
    ]
    for rank, m in enumerate(everyone):
        rows.append({"who": f"measured rank {rank}", **m["measured"]})
    return rows


def _predicted_calls(
    opt: zero.ZeroOptimizer, model: nn.Module, zcfg: zero.ZeroConfig, precision, world: int
):
    """{op: msg_bytes} one steady optimizer step should issue, from minispeed's formulas."""
    p_bytes = _bytes_of(precision.param_dtype)
    g_bytes = _bytes_of(precision.grad_accum_dtype)
    num_tensors = len({id(p) for p in model.parameters()})
    per_op: dict[str, int] = defaultdict(int)
    if zcfg.stage < 3:
        from minispeed.zero.ledger import stage_collectives

        strategy = opt.strategy
        calls = stage_collectives(
            zcfg.stage,
            world,
            strategy.bucket_numels(),
            strategy.gather_numels() if zcfg.stage > 0 else [],
            grad_bytes=g_bytes,
            param_bytes=p_bytes,
            num_params=num_tensors,
            gradient_accumulation_steps=zcfg.gradient_accumulation_steps,
            reduce_scatter=zcfg.reduce_scatter,
            clip_norm=zcfg.max_grad_norm > 0,
            flags_in_bucket=opt.flags_in_bucket,
        )
        for c in calls:
            per_op[c.op] += c.msg_bytes
        return per_op
    from minispeed.zero.stage3 import stage3_step_bytes

    shards = opt.strategy.sharded_params()
    b = stage3_step_bytes(
        [sp.numel for sp in shards],
        world,
        persistence_threshold_numel=zcfg.stage3_param_persistence_threshold_numel,
        param_bytes=p_bytes,
        grad_bytes=g_bytes,
    )
    a = zcfg.gradient_accumulation_steps
    per_op["all_gather"] += a * (b.forward_all_gather + b.backward_all_gather + b.trace_check)
    per_op["all_gather"] += b.persistent_all_gather  # re-gathered after the step
    per_op["reduce_scatter"] += a * b.reduce_scatter
    # Every stage, once per optimizer step: the overflow/unused-parameter flags (fp32, one per
    # parameter tensor plus one) and, with clipping, the squared global norm (one fp32).
    per_op["all_reduce"] += 4 * (num_tensors + 1) + (4 if zcfg.max_grad_norm > 0 else 0)
    return per_op


def _impl(op: str) -> str:
    """How comm runs `op` here (a reduce-scatter on gloo: comm's ring, or for ops other than
    SUM an all-reduce, which sends twice the ring's bytes)."""
    return comm.reduce_scatter_impl() if op == "reduce_scatter" else "native"


def _op(name: str) -> str:
    """The ledger's op: a coalesced all-gather is an all-gather (same bytes, fewer calls)."""
    return "all_gather" if name == "all_gather_coalesced" else name


def comm_ledger(
    opt: zero.ZeroOptimizer,
    model: nn.Module,
    log: comm.CommsLogger,
    zcfg: zero.ZeroConfig,
    precision: zero.MixedPrecision,
    world: int,
    steps: int,
) -> list[dict[str, Any]]:
    """Rows per op: predicted vs measured message and wire bytes of one steady optimizer step."""
    predicted = _predicted_calls(opt, model, zcfg, precision, world)
    steady = list(range(1, steps)) or [0]  # logger step k = optimizer step k + 1
    msg: dict[tuple[str, int], int] = defaultdict(int)
    wire: dict[tuple[str, int], int] = defaultdict(int)
    calls: dict[tuple[str, int], int] = defaultdict(int)
    for r in log.records:
        key = (_op(r.op), r.step)
        msg[key] += r.msg_bytes
        wire[key] += r.wire_bytes
        calls[key] += 1
    ops = sorted(set(predicted) | {op for op, _ in msg})
    rows = []
    for op in ops:
        per_step = [msg[op, s] for s in steady]
        pred = predicted.get(op, 0)
        rows.append(
            {
                "op": op,
                "calls_per_step": calls[op, steady[-1]],
                "predicted_msg_bytes": pred,
                "predicted_wire_bytes": (
                    costs.wire_bytes(op, pred, world, impl=_impl(op)) if pred else 0
                ),
                "measured_msg_bytes_min": min(per_step),
                "measured_msg_bytes_max": max(per_step),
                "measured_wire_bytes": max(wire[op, s] for s in steady),
                "first_step_msg_bytes": msg[op, 0],
            }
        )
    return rows


def _fmt(n: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _within(row: dict, ours: dict) -> bool:
    """Whether a measured row equals minispeed's formula up to the padding allowance, per column."""
    allowance = ours["allowance"]
    return all(abs(row[c] - ours[c]) <= allowance[c] for c in _COLUMNS)


def print_ledgers(
    console, memory_rows: list[dict], comm_rows: list[dict], stage: int, world: int
) -> None:
    """Render both ledgers as rich tables on ``console``."""
    from rich.table import Table

    mem = Table(
        title=f"memory ledger: model states per rank, ZeRO-{stage}, N = {world}",
        caption="other = buffers and flags; activations and communication buffers come on top",
    )
    mem.add_column("")
    for c in (*_COLUMNS, "other"):
        mem.add_column(c, justify="right")
    mem.add_column("vs minispeed formula", justify="right")
    ours = memory_rows[1]
    for row in memory_rows:
        if row["who"].startswith("measured"):
            verdict = "[green]equal up to padding[/]" if _within(row, ours) else "[red]differs[/]"
            verdict = f"{row['total'] / ours['total']:.4f}x {verdict}"
        else:
            verdict = ""
        other = _fmt(row["other"]) if "other" in row else ""
        mem.add_row(row["who"], *(_fmt(row[c]) for c in _COLUMNS), other, verdict)
    console.print(mem)

    tab = Table(
        title=f"communication ledger: one steady optimizer step, per rank, ZeRO-{stage}, N = {world}",
        caption="msg = nccl-tests message size; wire = bytes this rank sends on a ring; "
        "all_gather includes coalesced calls",
    )
    for col in (
        "op",
        "calls",
        "predicted msg",
        "measured msg",
        "predicted wire",
        "measured wire",
        "match",
    ):
        tab.add_column(col, justify="left" if col == "op" else "right")
    for r in comm_rows:
        lo, hi = r["measured_msg_bytes_min"], r["measured_msg_bytes_max"]
        measured = _fmt(lo) if lo == hi else f"{_fmt(lo)}..{_fmt(hi)}"
        ok = lo == hi == r["predicted_msg_bytes"]
        tab.add_row(
            r["op"],
            str(r["calls_per_step"]),
            _fmt(r["predicted_msg_bytes"]),
            measured,
            _fmt(r["predicted_wire_bytes"]),
            _fmt(r["measured_wire_bytes"]),
            "[green]exact[/]" if ok else f"[yellow]{hi / max(1, r['predicted_msg_bytes']):.3f}x[/]",
        )
    console.print(tab)
