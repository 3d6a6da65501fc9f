"""Memory proof and step time: Adam states in host memory vs swapped to NVMe (pipelined or not).

Run: ``.venv/bin/python benchmarks/offload_memory.py [--numel 50M] [--steps 3] [--dir /tmp]
[--trace trace.json]``

Each mode runs in a fresh process over the same ``--numel`` fp32 parameters (cut into 1M-element
tensors, random gradients): ``in memory`` (CPUAdam, states resident), ``nvme serial``
(SwappedOptimizer, pipeline_read/write off: read, step, write one partition after another) and
``nvme pipelined`` (prefetch the next partition and write back the previous while stepping).
Each reports its peak resident set (VmHWM, measured) and its mean step time after one warm-up
step. ``--trace`` writes a Chrome trace of one pipelined step (torch.profiler; the
``offload.*`` ranges show reads and writes overlapping the CPU step).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

from rich.console import Console
from rich.table import Table

WORKER = """
import json, sys, time, torch
from minispeed.offload import CPUAdam, OffloadOptimizerConfig, SwappedOptimizer

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

mode, numel, steps, nvme, trace = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
chunk = 1 << 20
params = [torch.nn.Parameter(torch.randn(min(chunk, numel - i))) for i in range(0, numel, chunk)]
for p in params:
    p.grad = torch.randn_like(p)
extra = {}
if mode == "in memory":
    opt = CPUAdam(params, lr=1e-4)
else:
    pipelined = mode == "nvme pipelined"
    cfg = OffloadOptimizerConfig(device="nvme", nvme_path=nvme, buffer_count=3,
                                 pipeline_read=pipelined, pipeline_write=pipelined)
    opt = SwappedOptimizer(params, cfg, sub_group_numel=4 * chunk, lr=1e-4)
    extra = {"swapped": opt.swapped_state_bytes(), "pool": opt.resident_state_bytes()}
opt.step()  # warm-up: allocates the states (in memory) or creates the files (nvme)
start = time.perf_counter()
for _ in range(steps):
    opt.step()
seconds = (time.perf_counter() - start) / steps
if trace != "-" and mode == "nvme pipelined":
    from torch.profiler import profile
    with profile() as prof:
        opt.step()
    prof.export_chrome_trace(trace)
print(json.dumps({"peak": peak(), "step_s": seconds, **extra}))
"""

_UNITS = {"K": 10**3, "M": 10**6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", default="50M")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--trace", default="-")
    args = parser.parse_args()
    t = args.numel
    numel = int(t[:-1]) * _UNITS[t[-1]] if t[-1] in _UNITS else int(t)
    console = Console(width=150)
    console.print(
        f"{numel:,} fp32 parameters, {args.steps} timed steps, swap dir {args.dir}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    results = {}
    for mode in ("in memory", "nvme serial", "nvme pipelined"):
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(WORKER), mode, str(numel), str(args.steps),
             args.dir, args.trace],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["in memory"]
    table = Table("mode", "peak RSS MB", "saved vs in memory MB", "states on disk MB",
                  "pool MB", "step s", "step / in memory")  # fmt: skip
    for mode, r in results.items():
        table.add_row(
            mode, f"{r['peak'] / 1e6:.0f}", f"{(base['peak'] - r['peak']) / 1e6:.0f}",
            f"{r.get('swapped', 0) / 1e6:.0f}", f"{r.get('pool', 0) / 1e6:.0f}",
            f"{r['step_s']:.2f}", f"{r['step_s'] / base['step_s']:.2f}",
        )  # fmt: skip
    console.print(table)


if __name__ == "__main__":
    main()
