"""Measure the machine for the performance model: matmul FLOP/s, the memory rate, the cost of
an operator call and of AdamW per parameter, and each collective's α and β.

    python -m minispeed.profiler calibrate [--nproc 2] [--out FILE]

- **Matmul** (`measure_matmul`): an n×n @ n×n float32 product (2n³ FLOPs) repeated for
  `seconds`, for each n in `sizes`; `measure_matmul_shapes` times the exact `(b, m, k, n)`
  products a profiled step ran, in interleaved rounds.
- **Memory** (`measure_stream`): bytes/s of a large element-wise add; **operator overhead**
  (`measure_op_overhead`): seconds per call of a one-element operator; **copy**
  (`measure_dram`): bytes read + written per second by a 64 MB copy, the DRAM rate; **optimizer**
  (`measure_adam`): seconds per parameter of `torch.optim.AdamW.step` (measured, not derived
  from a byte count: on a CPU torch's AdamW loops over the tensors, ~10 element-wise passes each),
  and `measure_adam_per_tensor`: its fixed cost per parameter tensor (those ~10 operator calls,
  which decide a small model's step); **gradient hook** (`measure_grad_hook`): seconds per
  gradient of a post-accumulate-grad hook that copies the gradient into a flat bucket, as ZeRO's
  reducers do for every parameter in every backward.
- With links, all of the above runs on `nproc` ranks at once (each rank's share of the cores).
- **Links** (needs `minispeed-comm`): the `nproc` local ranks time `all_reduce`,
  `all_gather` and `reduce_scatter` (through `minispeed.comm`, so as the backend really runs
  them: gloo has no reduce-scatter and comm runs all-reduce + slice) at several message sizes
  M, and fit `t = α + w/β` by least squares on relative error (`fit_alpha_beta`), w the bytes
  each rank sends: 2r·M for all-reduce, r·M for the others, r = (N-1)/N.

Every figure is a median of repeats (not a best-of): on a shared machine the step the model
predicts also runs at a typical, not a best, share of the cores.

Results go to `~/.cache/minispeed/profiler/calibration.json` (`perf_model.Machine.load`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from minispeed.core.files import atomic_write_json
from minispeed.profiler.launch import launch
from minispeed.profiler.perf_model import LinkCost, Machine

__all__ = [
    "LINK_BYTES",
    "calibrate",
    "fit_alpha_beta",
    "measure_adam",
    "measure_adam_per_tensor",
    "measure_dram",
    "measure_grad_hook",
    "measure_in_group",
    "measure_matmul",
    "measure_matmul_shapes",
    "measure_op_overhead",
    "measure_ranks",
    "measure_stream",
]

LINK_BYTES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024, 64 * 1024 * 1024)
"""Full-tensor sizes M at which each collective is timed: 4 KiB to 64 MiB, the largest beyond
the last-level cache (a collective of a whole model's parameters streams them from DRAM, and
costs more per byte than one of a few MiB)."""


def _rate(work: float, fn: Callable[[], object], seconds: float) -> float:
    """`work` per second of `fn`, repeated for at least `seconds` (and at least once)."""
    reps, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or reps == 0:
        fn()
        reps += 1
    return work * reps / elapsed


def measure_matmul(
    sizes: Sequence[int] = (128, 256, 512, 1024), seconds: float = 0.2
) -> dict[int, float]:
    """FLOP/s of float32 n×n matmuls on this process's threads, by n (median of 3 rounds)."""
    result = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        result[n] = statistics.median(
            _rate(2 * n**3, lambda a=a, b=b: a @ b, seconds / 3) for _ in range(3)
        )
    return result


def measure_matmul_shapes(
    shapes: Sequence[tuple[int, int, int, int]], seconds: float = 0.05, rounds: int = 3
) -> dict[tuple[int, int, int, int], float]:
    """FLOP/s of float32 products of each `(batch, m, k, n)` shape (`Profile.matmul_shapes`):
    small, thin products run far below the square-matrix peak. The shapes take turns for
    `rounds` rounds of `seconds / rounds` each (a burst of load hits all, not one), median."""
    operands = {}
    for b, m, k, n in shapes:
        x, y = torch.randn(b, m, k).squeeze(0), torch.randn(b, k, n).squeeze(0)
        x @ y  # warm-up
        operands[(b, m, k, n)] = (x, y)
    samples: dict[tuple[int, int, int, int], list[float]] = {s: [] for s in operands}
    for _ in range(rounds):
        for (b, m, k, n), (x, y) in operands.items():
            flops = 2 * b * m * k * n
            samples[(b, m, k, n)].append(_rate(flops, lambda x=x, y=y: x @ y, seconds / rounds))
    return {s: statistics.median(v) for s, v in samples.items()}


def measure_stream(numel: int = 2_000_000, seconds: float = 0.2) -> float:
    """Bytes/s of `c = a + b` on float32 vectors of `numel` (12 bytes moved per element): the
    rate of memory-bound element-wise work (median of 3 rounds)."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    torch.add(a, b, out=c)
    return statistics.median(
        _rate(12 * numel, lambda: torch.add(a, b, out=c), seconds / 3) for _ in range(3)
    )


def measure_op_overhead(calls: int = 2000) -> float:
    """Seconds per call of a one-element operator: the fixed cost every operator pays."""
    a, b = torch.ones(1), torch.ones(1)
    rounds = []
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(calls // 10):
            torch.add(a, b)
        rounds.append((time.perf_counter() - start) / (calls // 10))
    return statistics.median(rounds)


def measure_dram(numel: int = 16_000_000, seconds: float = 0.2) -> float:
    """Bytes read + written per second by `dst.copy_(src)` on float32 tensors of `numel` (64 MB
    each, beyond the cache; 8 bytes moved per element): the rate at which a step streams its
    parameters and ZeRO-3 unpacks a gathered model (median of 3 rounds)."""
    src, dst = torch.randn(numel), torch.empty(numel)
    dst.copy_(src)
    return statistics.median(
        _rate(8 * numel, lambda: dst.copy_(src), seconds / 3) for _ in range(3)
    )


def _median_adam_step(tensors: int, numel_each: int, steps: int) -> float:
    """Median seconds of `torch.optim.AdamW.step` over `tensors` float32 parameters of
    `numel_each` elements with gradients set, after one warm-up step."""
    params = [torch.nn.Parameter(torch.randn(numel_each)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_adam(numel: int = 8_000_000, tensors: int = 8, steps: int = 3) -> float:
    """Seconds per parameter of `torch.optim.AdamW.step` (torch's default implementation for
    CPU tensors: the single-tensor loop), on `tensors` float32 parameters of `numel` elements in all
    (by default 8M: parameters, gradients and moments far beyond the cache, as in a model) with
    gradients set, median of `steps` steps after one warm-up."""
    return _median_adam_step(tensors, numel // tensors, steps) / (numel // tensors * tensors)


def measure_adam_per_tensor(tensors: int = 64, numel: int = 64, steps: int = 5) -> float:
    """Seconds per parameter *tensor* of `torch.optim.AdamW.step`, beyond its per-element cost:
    `tensors` parameters of `numel` elements (so small that the arithmetic is negligible), the
    median step divided by `tensors`. torch's CPU AdamW issues ~10 operators per tensor, so a
    model of many small tensors pays this ~10·t_op per tensor more than its bytes suggest."""
    return _median_adam_step(tensors, numel, steps) / tensors


def measure_grad_hook(tensors: int = 64, numel: int = 64, steps: int = 7) -> float:
    """Seconds per gradient of a hook like ZeRO's (`register_post_accumulate_grad_hook`: look the
    parameter's slot up, copy its gradient into a flat bucket scaled by 1/N, free `param.grad`,
    count the bucket's arrivals): the same backward over `tensors` small parameters timed with and
    without the hooks, alternately, the difference of the fastest of each divided by `tensors`."""
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    flat = torch.zeros(tensors * numel)
    slots = {p: flat[i * numel : (i + 1) * numel] for i, p in enumerate(params)}
    arrived = [0]

    def hook(p: torch.Tensor) -> None:
        torch.mul(p.grad, 0.5, out=slots[p])
        p.grad = None
        arrived[0] += 1

    def backward() -> float:
        for p in params:
            p.grad = None
        loss = torch.stack([(p * p).sum() for p in params]).sum()
        start = time.perf_counter()
        loss.backward()
        return time.perf_counter() - start

    def hooked() -> float:
        handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
        try:
            return backward()
        finally:
            for h in handles:
                h.remove()

    backward(), hooked()  # warm-up
    # Alternated, and the fastest of each: a rank preempted during one backward (a shared
    # machine) slows that sample only, where a median of one side could land above the other's.
    pairs = [(backward(), hooked()) for _ in range(steps)]
    plain, with_hooks = min(a for a, _ in pairs), min(b for _, b in pairs)
    return max(with_hooks - plain, 0.0) / tensors


def fit_alpha_beta(wire_bytes: Sequence[float], seconds: Sequence[float]) -> LinkCost:
    """Least-squares fit of `t = α + w/β` to measured (bytes sent per rank, seconds) pairs,
    minimizing relative error (each equation divided by its t, so a 4 KiB call's 0.1 ms counts as
    much as a 16 MiB call's 50 ms). α is clamped to >= 0 and β to a positive rate."""
    # Rows (1/t, w/t) · (α, 1/β) ≈ 1: the 2×2 normal equations, solved by hand.
    a11 = a12 = a22 = b1 = b2 = 0.0
    for w, t in zip(wire_bytes, seconds, strict=True):
        u, v = 1.0 / t, w / t
        a11, a12, a22, b1, b2 = a11 + u * u, a12 + u * v, a22 + v * v, b1 + u, b2 + v
    det = a11 * a22 - a12 * a12
    alpha = (b1 * a22 - b2 * a12) / det
    inv_beta = (a11 * b2 - a12 * b1) / det
    if alpha < 0 or inv_beta <= 0:  # degenerate (noise): α = the smallest message's time
        alpha = max(0.0, min(seconds))
        slopes = [(t - alpha) / w for w, t in zip(wire_bytes, seconds, strict=True) if t > alpha]
        inv_beta = max(statistics.median(slopes) if slopes else 1e-12, 1e-12)
    return LinkCost(alpha_s=alpha, busbw_bytes_per_s=1.0 / inv_beta)


def _measure_compute(
    sizes: Sequence[int],
    seconds: float = 0.2,
    adam_numel: int = 8_000_000,
    dram_numel: int = 16_000_000,
) -> dict:
    return {
        "matmul_flops_per_s": {str(n): f for n, f in measure_matmul(sizes, seconds).items()},
        "stream_bytes_per_s": measure_stream(seconds=seconds),
        "op_overhead_s": measure_op_overhead(),
        "adam_s_per_param": measure_adam(adam_numel),
        "adam_s_per_tensor": measure_adam_per_tensor(),
        "hook_s_per_grad": measure_grad_hook(),
        "dram_bytes_per_s": measure_dram(dram_numel, seconds=seconds),
    }


def wire_bytes(op: str, full_bytes: float, n: int) -> float:
    """Bytes each of `n` ranks sends in one `op` on a tensor of `full_bytes` (ring algorithm)."""
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
    comm,
    sizes: Sequence[int] = (128, 256, 512, 1024),
    seconds: float = 0.2,
    link_bytes: Sequence[int] = LINK_BYTES,
    adam_numel: int = 8_000_000,
    dram_numel: int = 16_000_000,
) -> Machine:
    """Calibrate inside a running process group (every rank calls it; all get the same answer):
    compute rates with all ranks busy (the slowest rank's: it sets the step time), then each
    collective at every size of `link_bytes` (median of repeats, the slowest rank's time) and
    its α and β by `fit_alpha_beta`. `comm` is the `minispeed.comm` module (the profiler does
    not import it itself); `adam_numel` / `dram_numel` size `measure_adam` / `measure_dram`."""
    n = comm.get_world_size()
    comm.barrier()
    # All ranks at once: each its share of the cores.
    compute = _measure_compute(sizes, seconds, adam_numel, dram_numel)
    rates = [compute["matmul_flops_per_s"][str(k)] for k in sizes]
    rates += [compute["stream_bytes_per_s"], compute["dram_bytes_per_s"]]
    rates += [-compute["adam_s_per_tensor"], -compute["hook_s_per_grad"]]
    rates += [-compute["op_overhead_s"], -compute["adam_s_per_param"]]
    slowest = torch.tensor(rates, dtype=torch.float64)
    comm.all_reduce(slowest, op=comm.ReduceOp.MIN)
    links = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        times = []
        for full in link_bytes:
            x, shard = torch.ones(full // 4), torch.ones(full // 4 // n)
            if op == "reduce_scatter":  # in place, as ZeRO reduces its gradient buckets
                m = full // 4 // n
                shard = x[comm.get_rank() * m : (comm.get_rank() + 1) * m]
            _call(comm, op, x, shard)  # warm-up
            samples = []
            for _ in range(5 if full < 1024 * 1024 else 3):
                comm.barrier()
                start = time.perf_counter()
                _call(comm, op, x, shard)
                samples.append(time.perf_counter() - start)
            t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
            comm.all_reduce(t, op=comm.ReduceOp.MAX)
            times.append(t.item())
        links[op] = fit_alpha_beta([wire_bytes(op, b, n) for b in link_bytes], times)
    values = slowest.tolist()
    return Machine(
        matmul_flops_per_s=dict(zip(sizes, values[: len(sizes)], strict=True)),
        links=links,
        world_size=n,
        stream_bytes_per_s=values[-6],
        dram_bytes_per_s=values[-5],
        adam_s_per_tensor=-values[-4],
        hook_s_per_grad=-values[-3],
        op_overhead_s=-values[-2],
        adam_s_per_param=-values[-1],
    )


def _probe(out_path: str, sizes: Sequence[int]) -> None:
    """One rank of `measure_ranks`."""
    import minispeed.comm as comm

    comm.init_distributed()
    machine = measure_in_group(comm, sizes)
    if comm.get_rank() == 0:
        atomic_write_json(out_path, machine.to_json(), indent=None)
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
