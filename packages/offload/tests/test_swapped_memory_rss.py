"""Memory proof: with states on NVMe, the process's peak RSS drops by the state bytes swapped.

Two fresh processes train the same 4M parameters for 3 steps, one with the in-memory CPUAdam and
one with SwappedOptimizer; each reports its peak resident set (VmHWM from /proc, measured, not
computed). The swapped run must be lower by at least the state bytes it keeps on disk (8 B x 4M
= 32 MiB) minus what it holds instead: the buffer pool (2 buffers x 2 states x 1 MiB = 4 MiB) and the I/O engine's fixed
cost (its 8 worker threads' stacks and malloc arenas; SLACK, about 1 MiB measured). The benchmark
benchmarks/offload_memory.py shows the same at 50M parameters.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SLACK = 4 << 20  # bytes: I/O threads' stacks and arenas (about 1 MiB measured), with margin

WORKER = """
import json, sys, torch
from minispeed.offload import CPUAdam, OffloadOptimizerConfig, SwappedOptimizer

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

mode, nvme = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(1 << 18)) for _ in range(16)]  # 4M fp32 = 16 MiB
for p in params:
    p.grad = torch.randn_like(p)
if mode == "swapped":
    cfg = OffloadOptimizerConfig(device="nvme", nvme_path=nvme, buffer_count=2,
                                 pipeline_read=True, pipeline_write=True)
    opt = SwappedOptimizer(params, cfg, sub_group_numel=1 << 18, lr=1e-3)
    extra = {"swapped": opt.swapped_state_bytes(), "pool": opt.resident_state_bytes()}
else:
    opt = CPUAdam(params, lr=1e-3)
    extra = {}
for _ in range(3):
    opt.step()
print(json.dumps({"peak": peak(), "checksum": float(sum(p.sum() for p in params)), **extra}))
"""


def _run(mode: str, nvme: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WORKER), mode, str(nvme)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_peak_rss_drops_by_the_swapped_state_bytes(tmp_path: Path) -> None:
    in_memory = _run("in_memory", tmp_path)
    swapped = _run("swapped", tmp_path)
    assert swapped["checksum"] == in_memory["checksum"]  # the same training, bit for bit
    saved = in_memory["peak"] - swapped["peak"]
    assert swapped["swapped"] == 8 * (1 << 22)
    assert saved >= swapped["swapped"] - swapped["pool"] - SLACK, (
        f"peak RSS in memory {in_memory['peak']}, swapped {swapped['peak']}: saved {saved} B, "
        f"expected >= {swapped['swapped']} - {swapped['pool']} - {SLACK}"
    )
