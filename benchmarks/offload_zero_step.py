"""Offload through ZeRO: training step time with Adam states in memory, on the CPU Adam, or on NVMe.

Run: ``.venv/bin/python benchmarks/offload_zero_step.py [--sizes 1M,30M] [--steps 3] [--dir /tmp]``

For each size, three fresh single-rank processes train the same GPT-like MLP stack (width 512 or
1024, fp32) with ``zero.shard`` at stage 2 and AdamW, differing only in the ds_config:

- ``none``: torch's AdamW on the masters (the baseline);
- ``cpu``: ``offload_optimizer: {device: cpu}``, offload's SIMD CPU Adam;
- ``nvme``: ``offload_optimizer: {device: nvme, pipeline_read/write: true}``, states in swap files
  under ``--dir``, 100M-element sub-groups cut to 4M here so the swap pipeline runs.

Each reports its mean step time (forward + backward + step, after one warm-up step), the peak
resident set (VmHWM) and the bytes its swap files hold. The table gives ratios to ``none`` from the
same run. On a CPU-only machine the "device" is host memory, so ``cpu`` measures the optimizer
swap alone and ``nvme`` adds the disk traffic (8 B read + 8 B written per parameter per step).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap

from rich.console import Console
from rich.table import Table

WORKER = """
import json, sys, time, torch
import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.zero.memory import measure_offload

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

mode, numel, steps, nvme = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
comm.init_distributed()
width = 512 if numel < 8_000_000 else 1024
layers = max(1, round(numel / (width * width)))
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
section = {"stage": 2, "sub_group_size": 4_000_000}
if mode == "cpu":
    section["offload_optimizer"] = {"device": "cpu"}
elif mode == "nvme":
    section["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 3,
                                    "pipeline_read": True, "pipeline_write": True}
cfg = zero.ZeroConfig.from_section(section)
opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-4), config=cfg)
x = torch.randn(16, width)

def step():
    opt.backward(model(x).square().mean())
    opt.step()

step()  # warm-up: allocates the states (in memory) or creates the files (nvme)
start = time.perf_counter()
for _ in range(steps):
    step()
seconds = (time.perf_counter() - start) / steps
params = sum(p.numel() for p in model.parameters())
print(json.dumps({"seconds": seconds, "peak": peak(), "params": params,
                  "files": measure_offload(opt).files}))
"""

MODES = ("none", "cpu", "nvme")


def _parse_size(text: str) -> int:
    scale = {"K": 1_000, "M": 1_000_000}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def run(mode: str, numel: int, steps: int, nvme: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WORKER), mode, str(numel), str(steps), nvme],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{mode} at {numel}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,30M", help="parameter counts, e.g. 1M,30M")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="nvme_path for swap files")
    args = parser.parse_args()
    table = Table(title="zero.shard stage 2: step time with offload_optimizer (same run)")
    for col in ("params", "mode", "step (s)", "vs none", "peak RSS (MiB)", "swap files (MiB)"):
        table.add_column(col, justify="right")
    for size in args.sizes.split(","):
        numel = _parse_size(size)
        results = {mode: run(mode, numel, args.steps, args.dir) for mode in MODES}
        base = results["none"]["seconds"]
        for mode, r in results.items():
            table.add_row(
                f"{r['params'] / 1e6:.1f}M",
                mode,
                f"{r['seconds']:.3f}",
                f"{r['seconds'] / base:.2f}x",
                f"{r['peak'] / 2**20:.0f}",
                f"{r['files'] / 2**20:.0f}",
            )
    Console().print(table)


if __name__ == "__main__":
    main()
