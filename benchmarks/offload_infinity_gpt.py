"""ZeRO-Infinity on one box: a GPT with its parameters and Adam states on NVMe (issue 8, req. 5).

Run (not part of CI; validated only at small sizes on the shared development machine):

    .venv/bin/python benchmarks/offload_infinity_gpt.py --params 5M --steps 4 --dir /tmp/nvme

One process (a single-rank group) trains a GPT of about ``--params`` parameters with
``zero.shard`` at stage 3, AdamW (fp32 parameters by default: ``--dtype bfloat16`` for 16-bit
ones, whose matmuls are slow on CPUs without AVX-512 BF16), and

    offload_param:     {device: nvme, nvme_path: --dir}   (parameter shards in swap files)
    offload_optimizer: {device: nvme, nvme_path: --dir}   (Adam's exp_avg / exp_avg_sq in files)

It reports: the losses (they must fall), the model-state bytes (16 B per parameter: fp32 params,
grads and Adam's two states) against this machine's RAM, the peak resident set (VmHWM) as a
fraction of RAM, and where each step's time went: the bytes read and written by the swappers,
the time those would take at the disk's ``dd`` rate measured in the same run (``oflag=direct``
write, ``iflag=direct`` read of ``--dd-mib`` MiB), and the rest (compute and Python).

What stays in host memory today (so the 1.5x-RAM goal is out of reach until it moves too): the
fp32 masters (4 B/param: `SwappedOptimizer` swaps the two Adam states, not the master) and the
gradient shards from backward to the step (4 B/param in fp32), i.e. about half of the 16 B.
The peak RSS this script reports shows it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

WORKER = """
import json, sys, time, torch
import torch.nn.functional as F
from torch import nn
import minispeed.comm as comm
import minispeed.zero as zero

def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

target, steps, nvme, dtype = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.manual_seed(0)
comm.init_distributed()
vocab, block = 512, 64
layers = 8 if target >= 2_000_000 else 2
width = max(64, int((target / (12 * layers)) ** 0.5) // 64 * 64)  # 12 w^2 per block

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, 4, C // 4).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln = nn.LayerNorm(width)
    def forward(self, idx, tgt):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.ln(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())

model = GPT()
params = sum(p.numel() for p in model.parameters())
section = {
    "stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 4_000_000,
    "stage3_prefetch_bucket_size": 4 * width * width,
    "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 4,
                      "buffer_size": 4 * width * width + width},
    "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 3,
                          "pipeline_read": True, "pipeline_write": True},
}
opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=3e-3),
                 config=zero.ZeroConfig.from_ds_config({"zero_optimization": section}),
                 precision=zero.MixedPrecision(param_dtype=getattr(torch, dtype)))
g = torch.Generator().manual_seed(1)
data = torch.randint(0, vocab, (8, block + 1), generator=g)  # one batch, learned over the steps
idx, tgt = data[:, :-1], data[:, 1:]
param_sw, opt_sw = opt.strategy.param_home.swapper, opt.optimizer.swapper
losses, rows = [], []
for _ in range(steps):
    before = (param_sw.bytes_read, param_sw.bytes_written, opt_sw.bytes_read, opt_sw.bytes_written)
    start = time.perf_counter()
    loss = model(idx, tgt)
    opt.backward(loss)
    opt.step()
    seconds = time.perf_counter() - start
    after = (param_sw.bytes_read, param_sw.bytes_written, opt_sw.bytes_read, opt_sw.bytes_written)
    losses.append(loss.item())
    rows.append({"seconds": seconds,
                 "read": after[0] - before[0] + after[2] - before[2],
                 "written": after[1] - before[1] + after[3] - before[3]})
print(json.dumps({"params": params, "layers": layers, "width": width, "losses": losses,
                  "steps": rows, "peak": peak()}))
"""


def _size(text: str) -> int:
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def dd_rates(directory: str, mib: int) -> tuple[float, float]:
    """(write, read) bytes/s of ``dd`` with direct I/O on ``directory``'s file system."""
    path = os.path.join(directory, "dd-probe.bin")
    try:
        start = time.perf_counter()
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "oflag=direct"],
            check=True, capture_output=True,
        )  # fmt: skip
        write = mib * 2**20 / (time.perf_counter() - start)
        start = time.perf_counter()
        subprocess.run(
            ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"],
            check=True, capture_output=True,
        )  # fmt: skip
        read = mib * 2**20 / (time.perf_counter() - start)
        return write, read
    finally:
        if os.path.exists(path):
            os.remove(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="5M", help="about this many parameters, e.g. 5M")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="nvme_path (swap files)")
    parser.add_argument("--dd-mib", type=int, default=256, help="MiB for the dd probe")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="parameter dtype (bf16 matmuls are slow on CPUs without AVX-512 BF16)",
    )  # fmt: skip
    args = parser.parse_args()
    write_rate, read_rate = dd_rates(args.dir, args.dd_mib)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WORKER), str(_size(args.params)), str(args.steps),
         args.dir, args.dtype],
        capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(out.stderr[-4000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    ram = _ram_bytes()
    states = 16 * r["params"]
    print(f"GPT: {r['params'] / 1e6:.1f}M parameters ({r['layers']} layers, width {r['width']})")
    print(f"model states (fp32 params + grads + Adam m, v = 16 B/param): {states / 2**30:.3f} GiB "
          f"= {states / ram:.3f} x this machine's RAM ({ram / 2**30:.1f} GiB)")  # fmt: skip
    print(f"peak RSS: {r['peak'] / 2**20:.0f} MiB = {100 * r['peak'] / ram:.2f}% of RAM")
    print(f"dd direct I/O on {args.dir}: write {write_rate / 1e6:.0f} MB/s, "
          f"read {read_rate / 1e6:.0f} MB/s")  # fmt: skip
    print("step  loss     time(s)  read(MB)  written(MB)  I/O at dd rate(s)  rest(s)")
    for k, (loss, s) in enumerate(zip(r["losses"], r["steps"], strict=True)):
        io = s["read"] / read_rate + s["written"] / write_rate
        print(
            f"{k:>4}  {loss:.4f}  {s['seconds']:>7.2f}  {s['read'] / 1e6:>8.1f}  "
            f"{s['written'] / 1e6:>11.1f}  {io:>17.2f}  {s['seconds'] - io:>7.2f}"
        )
    falling = r["losses"][-1] < r["losses"][0]
    print(f"loss {'falls' if falling else 'does NOT fall'}: {r['losses'][0]:.4f} -> "
          f"{r['losses'][-1]:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
