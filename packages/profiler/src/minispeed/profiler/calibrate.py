"""Measure the machine for the performance model: matmul FLOP/s and each collective's α and β.

    python -m minispeed.profiler calibrate [--nproc 2] [--out FILE]

- **Matmul**: an n×n @ n×n float32 product (2n³ FLOPs) repeated for `seconds`, for each n in
  `sizes`; the best of three rounds.
- **Memory** (`measure_stream`): bytes/s of a large element-wise add; **operator overhead**
  (`measure_op_overhead`): seconds per call of a one-element operator.
- With links, all of the above runs on `nproc` ranks at once (each rank's share of the cores);
- **Links** (needs `minispeed-comm`): the `nproc` local ranks time `all_reduce`,
  `all_gather` and `reduce_scatter` (through `minispeed.comm`) at a small message (α: seconds
  per call) and a large one (β = bytes each rank sends / (time - α), bytes sent per rank being
  2r·M for all-reduce and r·M for the others, r = (N-1)/N, M the full tensor's bytes).

Results go to `~/.cache/minispeed/profiler/calibration.json` (`perf_model.Machine.load`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence

import torch

from minispeed.profiler.launch import launch
from minispeed.profiler.perf_model import LinkCost, Machine

__all__ = [
    "calibrate",
    "measure_in_group",
    "measure_matmul",
    "measure_matmul_shapes",
    "measure_op_overhead",
    "measure_ranks",
    "measure_stream",
]

SMALL_BYTES = 4 * 1024
LARGE_BYTES = 8 * 1024 * 1024


def measure_matmul(
    sizes: Sequence[int] = (128, 256, 512, 1024), seconds: float = 0.2
) -> dict[int, float]:
    """FLOP/s of float32 n×n matmuls on this process's threads, by n (best of 3 rounds)."""
    result = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        best = 0.0
        for _ in range(3):
            reps, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds / 3 or reps == 0:
                a @ b
                reps += 1
            best = max(best, 2 * n**3 * reps / elapsed)
        result[n] = best
    return result


def measure_matmul_shapes(
    shapes: Sequence[tuple[int, int, int, int]], seconds: float = 0.05
) -> dict[tuple[int, int, int, int], float]:
    """FLOP/s of float32 products of each `(batch, m, k, n)` shape (`Profile.matmul_shapes`):
    small, thin products run far below the square-matrix peak."""
    result = {}
    for b, m, k, n in shapes:
        x, y = torch.randn(b, m, k).squeeze(0), torch.randn(b, k, n).squeeze(0)
        x @ y
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or reps == 0:
            x @ y
            reps += 1
        result[(b, m, k, n)] = 2 * b * m * k * n * reps / elapsed
    return result


def measure_stream(numel: int = 2_000_000, seconds: float = 0.2) -> float:
    """Bytes/s of `c = a + b` on float32 vectors of `numel` (12 bytes moved per element): the
    rate of memory-bound element-wise work and of the optimizer step."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    torch.add(a, b, out=c)
    best = 0.0
    for _ in range(3):
        reps, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / 3 or reps == 0:
            torch.add(a, b, out=c)
            reps += 1
        best = max(best, 12 * numel * reps / elapsed)
    return best


def measure_op_overhead(calls: int = 2000) -> float:
    """Seconds per call of a one-element operator: the fixed cost every operator pays."""
    a, b = torch.ones(1), torch.ones(1)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            torch.add(a, b)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _measure_compute(sizes: Sequence[int], seconds: float = 0.2) -> dict:
    return {
        "matmul_flops_per_s": {str(n): f for n, f in measure_matmul(sizes, seconds).items()},
        "stream_bytes_per_s": measure_stream(seconds=seconds),
        "op_overhead_s": measure_op_overhead(),
    }


def _wire_bytes(op: str, full_bytes: float, n: int) -> float:
    r = (n - 1) / n
    return 2 * r * full_bytes if op == "all_reduce" else r * full_bytes


def _call(comm, op: str, full: torch.Tensor, shard: torch.Tensor) -> None:
    if op == "all_reduce":
        comm.all_reduce(full)
    elif op == "all_gather":
        comm.all_gather_into_tensor(full, shard)
    else:
        comm.reduce_scatter_tensor(shard, full)


def measure_in_group(
    comm, sizes: Sequence[int] = (128, 256, 512, 1024), seconds: float = 0.2
) -> Machine:
    """Calibrate inside a running process group (every rank calls it; all get the same answer):
    compute rates with all ranks busy (the slowest rank's: it sets the step time), then
    each collective's α (small message) and β (large message), the slowest rank's times.
    `comm` is the `minispeed.comm` module (the profiler does not import it itself)."""
    n = comm.get_world_size()
    comm.barrier()
    compute = _measure_compute(sizes, seconds)  # all ranks at once: each its share of the cores
    rates = [compute["matmul_flops_per_s"][str(k)] for k in sizes]
    rates += [compute["stream_bytes_per_s"], -compute["op_overhead_s"]]
    slowest = torch.tensor(rates, dtype=torch.float64)
    comm.all_reduce(slowest, op=comm.ReduceOp.MIN)
    times: dict[str, dict[int, float]] = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        times[op] = {}
        for full in (SMALL_BYTES, LARGE_BYTES):
            x, shard = torch.ones(full // 4), torch.ones(full // 4 // n)
            _call(comm, op, x, shard)  # warm-up
            best = float("inf")
            for _ in range(10 if full == SMALL_BYTES else 3):
                comm.barrier()
                start = time.perf_counter()
                _call(comm, op, x, shard)
                best = min(best, time.perf_counter() - start)
            t = torch.tensor([best], dtype=torch.float64)
            comm.all_reduce(t, op=comm.ReduceOp.MAX)
            times[op][full] = t.item()
    links = {}
    for op, t in times.items():
        alpha = t[SMALL_BYTES]
        beta = _wire_bytes(op, LARGE_BYTES, n) / max(t[LARGE_BYTES] - alpha, 1e-9)
        links[op] = LinkCost(alpha_s=alpha, busbw_bytes_per_s=beta)
    values = slowest.tolist()
    return Machine(
        matmul_flops_per_s=dict(zip(sizes, values[: len(sizes)], strict=True)),
        links=links,
        world_size=n,
        stream_bytes_per_s=values[-2],
        op_overhead_s=-values[-1],
    )


def _probe(out_path: str, sizes: Sequence[int]) -> None:
    """One rank of `measure_ranks`."""
    import minispeed.comm as comm

    comm.init_distributed()
    machine = measure_in_group(comm, sizes)
    if comm.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(machine.to_json(), f)
    comm.destroy_process_group()


def measure_ranks(
    nproc: int = 2, sizes: Sequence[int] = (128, 256, 512, 1024), timeout_s: float = 300
) -> Machine:
    """Calibrate on `nproc` local ranks at once (needs minispeed-comm): each rank's matmul and
    memory rates while all ranks compute, and each collective's α and β."""
    try:
        import minispeed.comm  # noqa: F401
    except ImportError:
        raise ImportError(
            "measuring link bandwidth runs collectives through minispeed.comm: "
            "pip install packages/comm (or skip the links with --no-links)"
        ) from None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "machine.json")
        argv = [sys.executable, "-m", "minispeed.profiler.calibrate", "--probe", out]
        launch(argv + [str(n) for n in sizes], nproc, {"OMP_NUM_THREADS": "1"}, timeout_s)
        with open(out) as f:
            return Machine.from_json(json.load(f))


def calibrate(
    nproc: int = 2, links: bool = True, sizes: Sequence[int] = (128, 256, 512, 1024)
) -> Machine:
    """Measure compute rates and (with `links`, on `nproc` ranks at once) the collectives."""
    if links:
        return measure_ranks(nproc, sizes)
    return Machine.from_json({**_measure_compute(sizes), "world_size": 1})


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--probe":
    _probe(sys.argv[2], [int(n) for n in sys.argv[3:]])
