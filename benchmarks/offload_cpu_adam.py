"""CPU Adam step time: minispeed's kernel vs torch.optim.AdamW (foreach, fused) vs the bandwidth floor.

Run: ``.venv/bin/python benchmarks/offload_cpu_adam.py [--sizes 10M,100M,500M] [--repeats 3]``

Every implementation steps the same fp32 tensors in this one process, round-robin, best of
``--repeats`` (the least disturbed run on a shared machine). An Adam step must read p, g, m, v and
write p, m, v: 28 bytes per element, so on a memory-bound CPU its floor is ``28 N / B`` seconds
with B the memory bandwidth, measured here in the same run as the best of two in-place streaming
kernels over N-element fp32 buffers, the access pattern of the step itself (every written buffer
is also read, so no cache line is fetched only to be overwritten): ``a.mul_(s)`` (8 B per
element) and ``a.add_(b)`` (12 B per element). "% of floor" = floor / measured time.

An out-of-place kernel such as ``dst.copy_(src)`` under-reports B for this purpose: the CPU reads
each line of ``dst`` before writing it (write-allocate), so 12 B move per element where 8 are
counted; an earlier version of this script measured B that way and reported steps at 120-160 %
of a floor they cannot beat.
"""

from __future__ import annotations

import argparse
import os

import torch
from rich.console import Console
from rich.table import Table
from timing import best_round_robin

from minispeed.offload import cpu_optim
from minispeed.offload.ops import load_op

_SIZES = {"10M": 10_000_000, "100M": 100_000_000, "500M": 500_000_000}


def _bench(numel: int, repeats: int) -> dict[str, float]:
    p = torch.randn(numel)
    g = torch.randn(numel)
    m = torch.zeros(numel)
    v = torch.zeros(numel)
    torch_params = [torch.nn.Parameter(p)]  # the same storage: every impl steps the same bytes
    torch_params[0].grad = g
    foreach = torch.optim.AdamW(torch_params, lr=1e-4, foreach=True)
    fused = torch.optim.AdamW(torch_params, lr=1e-4, fused=True)
    for opt in (foreach, fused):
        # torch's baselines step our m and v (same layout as theirs): no 8 B per element of states
        # of their own, so 500M elements fit in 10 GB (p, g, m, v, and `a` below).
        opt.state[torch_params[0]] = {"step": torch.tensor(0.0), "exp_avg": m, "exp_avg_sq": v}
    step = {"n": 0}

    def ours() -> None:
        step["n"] += 1
        cpu_optim.adam_step(
            [p], [g], [m], [v], step=step["n"], lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=0.01, decoupled_weight_decay=True,
        )  # fmt: skip

    a = torch.ones(numel)

    def scale() -> None:
        a.mul_(1.0)

    def add() -> None:
        a.add_(g)

    times = best_round_robin(
        {"scale": scale, "add": add, "minispeed": ours, "torch foreach": foreach.step,
         "torch fused": fused.step},
        repeats,
    )  # fmt: skip
    del foreach, fused
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M", help=f"comma list of {list(_SIZES)}")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    op = load_op()
    level = ["scalar", "AVX2", "AVX-512"][op.simd_levels()[-1]] if op else "reference"
    console = Console(width=150)
    console.print(
        f"threads {torch.get_num_threads()}, SIMD {level}, load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs, best of {args.repeats}"
    )
    table = Table("elements", "bandwidth GB/s", "floor ms", "minispeed ms", "% of floor",
                  "foreach ms", "fused ms", "fused / minispeed")  # fmt: skip
    for label in args.sizes.split(","):
        n = _SIZES[label.strip()]
        t = _bench(n, args.repeats)
        bandwidth = max(8 * n / t["scale"], 12 * n / t["add"])
        floor = cpu_optim.step_bytes("adam", n) / bandwidth
        table.add_row(
            label, f"{bandwidth / 1e9:.2f}", f"{floor * 1e3:.0f}", f"{t['minispeed'] * 1e3:.0f}",
            f"{100 * floor / t['minispeed']:.0f}%", f"{t['torch foreach'] * 1e3:.0f}",
            f"{t['torch fused'] * 1e3:.0f}", f"{t['torch fused'] / t['minispeed']:.2f}x",
        )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
