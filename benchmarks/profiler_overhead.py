"""What profiling a training step costs, and what the profile says, at two model sizes.

For examples/gpt.py's GPT at a small size and at ~35M parameters, one process:

- `plain`: forward + backward of one micro-batch, unprofiled (median of `--reps`);
- `hooks`: the same inside `FlopsProfiler(count_ops=False)` (module hooks and timers only);
- `count`: inside `FlopsProfiler(model)` (hooks + the TorchDispatchMode pricing every operator).

It prints the overhead ratios (same run, same load), the forward FLOPs against
`formulas.gpt_forward` (the analytic count), achieved FLOP/s and the fraction of the measured
matmul peak (`calibrate.measure_matmul`, best n×n float32 product).

    python benchmarks/profiler_overhead.py [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT, GPTConfig

from minispeed.profiler import FlopsProfiler, formulas
from minispeed.profiler.calibrate import measure_matmul

SIZES = {
    "small (0.8M)": dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128, batch=4),
    "35M": dict(vocab_size=8192, block_size=64, n_layer=6, n_head=10, n_embd=640, batch=1),
}


def _step(model: GPT, idx: torch.Tensor) -> None:
    _, loss = model(idx, idx)
    loss.backward()
    model.zero_grad(set_to_none=True)


def _time_step(kind: str, model: GPT, idx: torch.Tensor) -> float:
    """Seconds of one step: `plain`, under the profiler's hooks only, or `count`ing."""
    profiler = {
        "plain": contextlib.nullcontext(),
        "hooks": FlopsProfiler(model, count_ops=False),
        "count": FlopsProfiler(model),
    }[kind]
    start = time.perf_counter()
    with profiler:
        _step(model, idx)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    peak = max(measure_matmul(sizes=(256, 512, 1024), seconds=0.3).values())
    print(f"measured matmul peak: {peak / 1e9:.2f} GFLOP/s ({args.threads} thread(s))")
    for label, spec in SIZES.items():
        spec = dict(spec)
        batch = spec.pop("batch")
        torch.manual_seed(0)
        cfg = GPTConfig(**spec)
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size))
        _step(model, idx)  # warm-up (allocations, the dispatch mode's first use)
        with FlopsProfiler(model):
            _step(model, idx)

        # Interleave the three so that machine load falls on all alike.
        times: dict[str, list[float]] = {"plain": [], "hooks": [], "count": []}
        for _ in range(args.reps):
            for kind in times:
                times[kind].append(_time_step(kind, model, idx))
        plain_t, hooks_t, count_t = times.values()
        plain, hook, cnt = (statistics.median(t) for t in (plain_t, hooks_t, count_t))
        with FlopsProfiler(model, peak_flops_per_s=peak) as prof:
            _step(model, idx)
        r = prof.result()
        analytic = formulas.gpt_forward(
            batch=batch, seq=cfg.block_size, n_layer=cfg.n_layer, n_embd=cfg.n_embd,
            n_head=cfg.n_head, vocab=cfg.vocab_size,
        )  # fmt: skip
        err = (r.forward.flops - analytic.flops) / analytic.flops
        print(
            f"{label}: {cfg.num_params() / 1e6:.1f}M params, step {plain * 1e3:.1f} ms; "
            f"hooks {hook / plain:.2f}x, counting {cnt / plain:.2f}x; "
            f"forward {r.forward.flops / 1e9:.3f} GFLOP (analytic {analytic.flops / 1e9:.3f}, "
            f"diff {100 * err:+.4f}%), backward/forward {r.backward.flops / r.forward.flops:.3f}; "
            f"achieved {r.flops_per_s / 1e9:.2f} GFLOP/s = {100 * (r.peak_fraction or 0):.0f}% "
            f"of peak (while counting: plain step {r.flops / plain / 1e9:.2f} GFLOP/s = "
            f"{100 * r.flops / plain / peak:.0f}%)"
        )


if __name__ == "__main__":
    main()
