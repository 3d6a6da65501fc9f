"""Measure the machine for the performance model: matmul FLOP/s and each collective's α and β.

    python -m minispeed.profiler calibrate [--nproc 2] [--out FILE]

- **Matmul**: an n×n @ n×n float32 product (2n³ FLOPs) repeated for `seconds`, for each n in
  `sizes`; the best of three rounds.
- **Links** (needs `minispeed-comm`): `nproc` local ranks time `all_reduce`,
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

__all__ = ["calibrate", "measure_links", "measure_matmul"]

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


def _probe(out_path: str) -> None:
    """One rank of the link measurement (run by `measure_links` in each process)."""
    import minispeed.comm as comm

    comm.init_distributed()
    n, rank = comm.get_world_size(), comm.get_rank()
    times: dict[str, dict[int, float]] = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        times[op] = {}
        for full in (SMALL_BYTES, LARGE_BYTES):
            numel = full // 4
            x = torch.ones(numel)
            shard = torch.ones(numel // n)

            _call(comm, op, x, shard)
            reps = 20 if full == SMALL_BYTES else 5
            best = float("inf")
            for _ in range(reps):
                comm.barrier()
                start = time.perf_counter()
                _call(comm, op, x, shard)
                best = min(best, time.perf_counter() - start)
            times[op][full] = best
    if rank == 0:
        links = {}
        for op, t in times.items():
            alpha = t[SMALL_BYTES]
            beta = _wire_bytes(op, LARGE_BYTES, n) / max(t[LARGE_BYTES] - alpha, 1e-9)
            links[op] = {"alpha_s": alpha, "busbw_bytes_per_s": beta}
        with open(out_path, "w") as f:
            json.dump(links, f)
    comm.destroy_process_group()


def measure_links(nproc: int = 2, timeout_s: float = 300) -> dict[str, LinkCost]:
    """α and β of each collective on `nproc` local ranks (needs minispeed-comm)."""
    try:
        import minispeed.comm  # noqa: F401
    except ImportError:
        raise ImportError(
            "measuring link bandwidth runs collectives through minispeed.comm: "
            "pip install packages/comm (or skip the links with --no-links)"
        ) from None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "links.json")
        env = {"OMP_NUM_THREADS": "1"}
        launch(
            [sys.executable, "-m", "minispeed.profiler.calibrate", "--probe", out],
            nproc,
            env,
            timeout_s,
        )
        with open(out) as f:
            return {op: LinkCost(**v) for op, v in json.load(f).items()}


def calibrate(
    nproc: int = 2, links: bool = True, sizes: Sequence[int] = (128, 256, 512, 1024)
) -> Machine:
    """Measure matmul throughput and (with `links`) the collectives of `nproc` ranks."""
    return Machine(
        matmul_flops_per_s=measure_matmul(sizes),
        links=measure_links(nproc) if links else {},
        world_size=nproc,
    )


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--probe":
    _probe(sys.argv[2])
