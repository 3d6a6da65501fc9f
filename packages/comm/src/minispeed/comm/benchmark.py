"""Timing loops for benchmarks/comm_collectives.py: our collectives against plain torch.distributed.

Lives inside minispeed.comm because the baseline calls torch.distributed directly, which only this
package may do. `measure` runs on every rank of an initialized group; the script spawns the
processes and prints the table.

Method: for each (op, message size), the three variants (`torch`: the raw torch.distributed
call; `comm`: ours with the logger off; `comm+log`: ours with a `CommsLogger` on) run
interleaved, `rounds` times, each round timing `iters` back-to-back calls between barriers.
A variant's time is the best (minimum) over rounds of the slowest rank's mean per-call time:
on a shared machine other processes only ever add time, so the minimum is the most repeatable
estimate. Bus bandwidth follows `minispeed.comm.costs`.

`measure_dispatch` isolates what we add per call (checks, bookkeeping, logging) from the
network: each rank calls on a group of one (itself), so the backend does no communication, and
the difference to torch is our overhead in microseconds.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from minispeed.comm import all_to_all, api_compat, call, collectives, costs, handshake, validation
from minispeed.comm.logger import CommsLogger
from minispeed.core import ranges

__all__ = [
    "CHECK_VARIANTS",
    "IN_PLACE",
    "OPS",
    "VARIANTS",
    "measure",
    "measure_checks",
    "measure_dispatch",
    "measure_reduce_scatter_impls",
]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
IN_PLACE = "reduce_scatter_in_place"
"""`measure`'s extra row: a reduce-scatter whose output is this rank's chunk of its input, as ZeRO
calls it (on gloo comm runs it as its ring over p2p: Note [gloo's reduce-scatter is an
all-reduce] in api_compat)."""
VARIANTS = ("torch", "comm", "comm+log")
CHECK_VARIANTS = ("off", "first", "all", "objects")
"""Cross-rank checks timed by `measure_checks`: none; the default (first call of each call site,
timed after it, so the steady state); every call (fingerprint); every call with the object
exchange that validation mode used before the fingerprint (pickled signatures, two all-gathers)."""


def _buffers(op: str, numel: int, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input, output, msg_bytes) for a message of `numel` fp32 elements (nccl-tests sizes)."""
    numel = max(n, numel // n * n)  # divisible by n for the scatter/gather family
    if op == "all_gather":
        inp, out = torch.ones(numel // n), torch.empty(numel)
    elif op == "reduce_scatter":
        inp, out = torch.ones(numel), torch.empty(numel // n)
    elif op == IN_PLACE:
        m, r = numel // n, dist.get_rank()
        inp = torch.ones(numel)
        out = inp[r * m : (r + 1) * m]
    else:
        inp, out = torch.ones(numel), torch.empty(numel)
    return inp, out, numel * 4


def _call(
    op: str, variant: str, inp: torch.Tensor, out: torch.Tensor, group: Any = None, src: int = 0
) -> Callable[[], Any]:
    g = group
    op = "reduce_scatter" if op == IN_PLACE else op  # the same calls, on in-place buffers
    if variant == "torch":
        return {
            "all_reduce": lambda: dist.all_reduce(inp, group=g),
            "all_gather": lambda: call.ALL_GATHER_FLAT_NATIVE(out, inp, group=g),
            "reduce_scatter": lambda: call.REDUCE_SCATTER_FLAT_NATIVE(out, inp, group=g),
            "broadcast": lambda: dist.broadcast(inp, src, group=g),
            "all_to_all": lambda: dist.all_to_all_single(out, inp, group=g),
        }[op]
    return {
        "all_reduce": lambda: collectives.all_reduce(inp, group=g),
        "all_gather": lambda: collectives.all_gather_into_tensor(out, inp, group=g),
        "reduce_scatter": lambda: collectives.reduce_scatter_tensor(out, inp, group=g),
        "broadcast": lambda: collectives.broadcast(inp, src, group=g),
        "all_to_all": lambda: all_to_all.all_to_all_single(out, inp, group=g),
    }[op]


def _mean_call_seconds(fn: Callable[[], Any], iters: int, log: CommsLogger | None) -> float:
    """This rank's mean seconds per call over `iters` calls (inside `log` when given)."""
    t0 = time.perf_counter()
    with log if log is not None else contextlib.nullcontext():
        for _ in range(iters):
            fn()
    return (time.perf_counter() - t0) / iters


def _time_round(fn: Callable[[], Any], iters: int, log: CommsLogger | None) -> float:
    """Slowest rank's mean seconds per call over `iters` calls."""
    dist.barrier()
    per_call = torch.tensor([_mean_call_seconds(fn, iters, log)], dtype=torch.float64)
    dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
    return float(per_call)


def measure(
    ops: tuple[str, ...] = (*OPS, IN_PLACE),
    sizes: tuple[int, ...] = (1 << 8, 1 << 12, 1 << 16, 1 << 20),
    rounds: int = 5,
    target_s: float = 0.05,
) -> list[dict[str, Any]]:
    """One row per (op, size): seconds per call, busbw per variant, overhead ratios vs torch.

    `sizes` are message sizes in fp32 elements; `iters` per round is chosen from one
    calibration call so that a round takes about `target_s` seconds.
    """
    n = dist.get_world_size()
    rows = []
    for op in ops:
        for size in sizes:
            inp, out, msg_bytes = _buffers(op, size, n)
            fns = {v: _call(op, v, inp, out) for v in VARIANTS}
            for fn in fns.values():  # warm-up (connections, allocations)
                fn()
            probe = _time_round(fns["torch"], 2, None)
            iters = max(3, min(200, int(target_s / max(probe, 1e-6))))
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for _ in range(rounds):
                for v in VARIANTS:
                    log = CommsLogger() if v == "comm+log" else None
                    times[v].append(_time_round(fns[v], iters, log))
            med = {v: min(ts) for v, ts in times.items()}
            factor = costs.bus_bandwidth_factor("reduce_scatter" if op == IN_PLACE else op, n)
            rows.append(
                {
                    "op": op,
                    "msg_bytes": msg_bytes,
                    "world_size": n,
                    "iters": iters,
                    **{f"time_s[{v}]": med[v] for v in VARIANTS},
                    **{f"busbw_GBps[{v}]": msg_bytes / med[v] * factor / 1e9 for v in VARIANTS},
                    "ratio[comm/torch]": med["comm"] / med["torch"],
                    "ratio[comm+log/torch]": med["comm+log"] / med["torch"],
                }
            )
    return rows


def measure_dispatch(
    ops: tuple[str, ...] = OPS, iters: int = 2000, rounds: int = 5
) -> list[dict[str, Any]]:
    """Microseconds per call of each variant on a one-rank group (no communication).

    Every rank creates every solo group (group creation is collective), then times calls on its own.
    """
    me = dist.get_rank()
    solo = None
    for r in range(dist.get_world_size()):
        g = dist.new_group([r])
        if r == me:
            solo = g
    inp, out = torch.ones(1), torch.empty(1)
    rows = []
    for op in ops:
        fns = {v: _call(op, v, inp, out, group=solo, src=me) for v in VARIANTS}
        best: dict[str, float] = {}
        for v, fn in fns.items():
            for _ in range(50):
                fn()
            samples = []
            for _ in range(rounds):
                log = CommsLogger() if v == "comm+log" else None
                samples.append(_mean_call_seconds(fn, iters, log))
            best[v] = min(samples)
        rows.append(
            {
                "op": op,
                **{f"us_per_call[{v}]": best[v] * 1e6 for v in VARIANTS},
                "overhead_us[comm]": (best["comm"] - best["torch"]) * 1e6,
                "overhead_us[comm+log]": (best["comm+log"] - best["torch"]) * 1e6,
            }
        )
    return rows


def measure_checks(numel: int = 256, iters: int = 300, rounds: int = 5) -> dict[str, Any]:
    """Microseconds per small all-reduce (`numel` fp32) on the world group under each of
    `CHECK_VARIANTS`, best of `rounds` rounds of the slowest rank's mean; plus the cost of one
    `ranges.range` enter/exit when nothing listens, in microseconds."""
    t = torch.ones(numel)
    signature = (("dtype", str(t.dtype)), ("op", "ReduceOp.SUM"), ("shape", tuple(t.shape)))

    def objects() -> None:  # the previous validation mode: pickled signatures, every call
        validation.compare_in_full("all_reduce", None, signature)
        collectives.all_reduce(t)

    def site() -> None:  # one call site for every round: checked once, on the first call
        collectives.all_reduce(t)

    modes = {"off": "off", "first": "first", "all": "all", "objects": "off"}
    fns = {"off": site, "first": site, "all": site, "objects": objects}
    best: dict[str, float] = {}
    for v in CHECK_VARIANTS:
        with handshake.validation_mode(modes[v]):
            for _ in range(10):
                fns[v]()
    for _ in range(rounds):  # interleaved: load from other programs falls on every variant
        for v in CHECK_VARIANTS:
            with handshake.validation_mode(modes[v]):
                s = _time_round(fns[v], iters, None)
            best[v] = min(best.get(v, s), s)
    probe = ranges.range("comm.all_reduce")
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(20000):
            with probe:
                pass
        samples.append((time.perf_counter() - t0) / 20000)
    return {
        "numel": numel,
        **{f"us_per_call[{v}]": best[v] * 1e6 for v in CHECK_VARIANTS},
        **{f"ratio[{v}/off]": best[v] / best["off"] for v in CHECK_VARIANTS},
        "range_us": min(samples) * 1e6,
    }


RS_IMPLS = ("torch", "all_reduce", "ring_p2p")
"""`measure_reduce_scatter_impls`' contenders for an in-place reduce-scatter on gloo: torch's own
(`reduce_scatter_single`: an all-reduce of a clone), comm's all-reduce of the input
(`all_reduce_in_place`, main's choice before the ring) and comm's ring (`ring_p2p`)."""


def measure_reduce_scatter_impls(
    sizes: tuple[int, ...] = (1 << 18, 1 << 20, 1 << 22, 1 << 24),
    rounds: int = 5,
    target_s: float = 0.2,
) -> list[dict[str, Any]]:
    """One row per message size (fp32 elements): seconds per in-place reduce-scatter (ZeRO's
    call) of each `RS_IMPLS` contender, wall (slowest rank's mean) and CPU time (process time
    of every thread, the backend's too, mean over ranks), best of `rounds` interleaved rounds."""
    n = dist.get_world_size()
    rows = []
    for size in sizes:
        inp, out, msg_bytes = _buffers(IN_PLACE, size, n)
        m = out.numel()
        run = functools.partial(_reduce_scatter_as, inp=inp, out=out)

        for v in RS_IMPLS:  # warm-up
            run(v)
        probe = _time_round(functools.partial(run, "torch"), 2, None)
        iters = max(3, min(100, int(target_s / max(probe, 1e-6))))
        wall: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for _ in range(rounds):
            for v in RS_IMPLS:
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(iters):
                    run(v)
                got = torch.tensor(
                    [(time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters],
                    dtype=torch.float64,
                )
                w = got[:1].clone()
                dist.all_reduce(w, op=dist.ReduceOp.MAX)
                dist.all_reduce(got)  # cpu: summed over ranks
                wall[v] = min(wall.get(v, float("inf")), float(w))
                cpu[v] = min(cpu.get(v, float("inf")), float(got[1]) / n)
        rows.append(
            {
                "msg_bytes": msg_bytes,
                "world_size": n,
                "chunk_numel": m,
                "iters": iters,
                **{f"wall_s[{v}]": wall[v] for v in RS_IMPLS},
                **{f"cpu_s[{v}]": cpu[v] for v in RS_IMPLS},
            }
        )
    return rows


def _reduce_scatter_as(v: str, inp: torch.Tensor, out: torch.Tensor) -> None:
    """One reduce-scatter of `inp` into `out` by `RS_IMPLS`' contender `v`."""
    if v == "torch":
        call.REDUCE_SCATTER_FLAT_NATIVE(out, inp)
        return
    with api_compat.reduce_scatter_as(v):
        collectives.reduce_scatter_tensor(out, inp)
