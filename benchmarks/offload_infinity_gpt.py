"""ZeRO-Infinity on one box: a GPT bigger than the machine's RAM, everything on NVMe (issue 8, req. 5).

Run (not part of CI; the recorded run and its figures are in docs/packages/offload.md):

    .venv/bin/python benchmarks/offload_infinity_gpt.py --width 3072 --layers 22 --steps 3 \
        --lr 1e-5 --dir /tmp/infinity-swap --dd-mib 1024

(2.49B parameters: 16 B/param = 1.58x a 23.5 GiB machine's RAM; ~50 GB of swap files, removed
at exit; ~22 minutes on a 2-core machine with a ~0.4-0.6 GB/s disk.) Small: ``--params 5M``.

One process (a single-rank group) builds a GPT under ``zero.Init(config)`` (each shard goes to
its swap file as its module is built: the model never exists in memory) and trains it with
``zero.shard`` at stage 3, AdamW (fp32 by default; ``--dtype bfloat16`` for 16-bit parameters,
whose matmuls are slow on CPUs without AVX-512 BF16), and

    offload_param:     {device: nvme, nvme_path: --dir}   (parameter shards in swap files)
    offload_optimizer: {device: nvme, nvme_path: --dir}   (fp32 masters + Adam states, and the
                                                           gradient shards, in swap files)

It reports: the losses (they must fall), the model-state bytes (16 B per parameter: fp32 params,
grads and Adam's two states) against this machine's RAM, the peak resident set (VmHWM) as a
fraction of RAM, and per step: forward+backward and optimizer-step seconds, the bytes the three
swappers read and wrote, the seconds spent blocked on reads and on writes (the I/O the pipelines
did not hide), the time the traffic would take at the disk's ``dd`` rate measured in the same
run (``oflag=direct`` write, ``iflag=direct`` read of ``--dd-mib`` MiB), the seconds with any
swap I/O in flight (`minispeed.offload.io_busy_seconds`) and the share of those spent at ``dd``'s
rate (the traffic at ``dd``'s rate over them), and the rest (compute). ``--pages 4k`` puts the
swap buffers on torch's 4 KiB pages, as before Note [I/O buffers on huge pages] (aio.py).
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

target, steps, nvme, dtype, width, layers, vocab, batch, block, lr, pages = sys.argv[1:12]
target, steps, width, layers = int(target), int(steps), int(width), int(layers)
vocab, batch, block = int(vocab), int(batch), int(block)
if pages == "4k":  # the swap buffers before Note [I/O buffers on huge pages]: torch's 4 KiB pages
    import minispeed.offload.aio as aio_mod, minispeed.offload.swapper as swapper_mod
    def small_pages(nbytes):
        padded = -(-nbytes // 4096) * 4096
        raw = torch.empty(padded + 4096, dtype=torch.uint8)
        start = (-raw.data_ptr()) % 4096
        return raw[start : start + padded]
    aio_mod.io_buffer = swapper_mod.io_buffer = small_pages
from minispeed.offload import io_busy_seconds
torch.manual_seed(0)
comm.init_distributed()
if not layers:
    layers = 8 if target >= 2_000_000 else 2
if not width:
    width = max(64, int((target / (12 * layers)) ** 0.5) // 64 * 64)  # 12 w^2 per block
big = 4 * width * width  # the largest tensor: the MLP's (4w, w) weights

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
        # GPT-2's init (a first loss near ln(vocab)), on the gathered, already-offloaded values
        with zero.GatheredParameters([self.wte.weight, self.wpe.weight], modifier_rank=0):
            nn.init.normal_(self.wte.weight, std=0.02)
            nn.init.normal_(self.wpe.weight, std=0.02)
    def forward(self, idx, tgt):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.ln(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())

section = {
    "stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": big,
    "stage3_prefetch_bucket_size": big, "stage3_max_live_parameters": 2 * big,
    "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 3,
                      "buffer_size": big},
    "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 3,
                          "pipeline_read": True, "pipeline_write": True},
}
aio = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 2}
config = zero.ZeroConfig.from_section(section, aio=aio)
start = time.perf_counter()
with zero.Init(config=config) as init:  # each shard goes to its swap file as it is made
    model = GPT()
params = sum(sp.numel for sp in init.sharded)
built = time.perf_counter() - start
opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=float(lr)),
                 config=config, precision=zero.MixedPrecision(param_dtype=getattr(torch, dtype)))
setup = time.perf_counter() - start
g = torch.Generator().manual_seed(1)
data = torch.randint(0, vocab, (batch, block + 1), generator=g)  # one batch, learned over the steps
idx, tgt = data[:, :-1], data[:, 1:]
swappers = [opt.strategy.param_home.swapper, opt.optimizer.swapper, opt.optimizer.grads.swapper]

def io():
    return [sum(s.bytes_read for s in swappers), sum(s.bytes_written for s in swappers),
            sum(s.wait_s["read"] for s in swappers), sum(s.wait_s["write"] for s in swappers),
            io_busy_seconds()]

losses, rows = [], []
for _ in range(steps):
    before = io()
    start = time.perf_counter()
    loss = model(idx, tgt)
    opt.backward(loss)
    middle = time.perf_counter()
    opt.step()
    seconds = time.perf_counter() - start
    after = io()
    losses.append(loss.item())
    rows.append({"seconds": seconds, "fwd_bwd": middle - start, "step": seconds - (middle - start),
                 "read": after[0] - before[0], "written": after[1] - before[1],
                 "read_wait": after[2] - before[2], "write_wait": after[3] - before[3],
                 "io_busy": after[4] - before[4]})
print(json.dumps({"params": params, "layers": layers, "width": width, "losses": losses,
                  "steps": rows, "peak": peak(), "build_s": built, "setup_s": setup,
                  "resident": opt.optimizer.resident_state_bytes()}))
opt.close() if params < 500_000_000 else None  # close() gathers the whole model into memory
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
    parser.add_argument("--width", type=int, default=0, help="model width (0: from --params)")
    parser.add_argument("--layers", type=int, default=0, help="blocks (0: from --params)")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--block", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW's learning rate")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="nvme_path (swap files)")
    parser.add_argument("--dd-mib", type=int, default=256, help="MiB for the dd probe")
    parser.add_argument("--json", default="", help="also write the raw results here")
    parser.add_argument(
        "--pages", default="huge", choices=["huge", "4k"],
        help="swap buffers on huge pages (the swapper's own) or on torch's 4 KiB pages (before)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="parameter dtype (bf16 matmuls are slow on CPUs without AVX-512 BF16)",
    )  # fmt: skip
    args = parser.parse_args()
    write_rate, read_rate = dd_rates(args.dir, args.dd_mib)
    argv = [_size(args.params), args.steps, args.dir, args.dtype, args.width, args.layers,
            args.vocab, args.batch, args.block, args.lr, args.pages]  # fmt: skip
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WORKER), *map(str, argv)],
        capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(out.stderr[-4000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r.update(wall_s=time.perf_counter() - start, dd_write=write_rate, dd_read=read_rate)
    ram = _ram_bytes()
    r["ram"] = ram
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    states = 16 * r["params"]
    print(f"GPT: {r['params'] / 1e6:.1f}M parameters ({r['layers']} layers, width {r['width']}),"
          f" batch {args.batch} x {args.block} tokens")  # fmt: skip
    print(f"model states (fp32 params + grads + Adam m, v = 16 B/param): {states / 2**30:.3f} GiB "
          f"= {states / ram:.3f} x this machine's RAM ({ram / 2**30:.1f} GiB)")  # fmt: skip
    print(f"peak RSS: {r['peak'] / 2**20:.0f} MiB = {100 * r['peak'] / ram:.2f}% of RAM "
          f"(optimizer + gradient pools: {r['resident'] / 2**20:.0f} MiB)")  # fmt: skip
    print(f"build under zero.Init: {r['build_s']:.1f} s; until trainable (masters written): "
          f"{r['setup_s']:.1f} s; whole run: {r['wall_s']:.1f} s")  # fmt: skip
    print(f"dd direct I/O on {args.dir}: write {write_rate / 1e6:.0f} MB/s, "
          f"read {read_rate / 1e6:.0f} MB/s")  # fmt: skip
    print("step  loss      time(s)  fwd+bwd  step  read(GB)  written(GB)  blocked on read/write(s)"
          "  I/O at dd rate(s)  I/O busy(s)  dd rate / busy  rest=compute(s)")  # fmt: skip
    for k, (loss, s) in enumerate(zip(r["losses"], r["steps"], strict=True)):
        io = s["read"] / read_rate + s["written"] / write_rate
        blocked = s["read_wait"] + s["write_wait"]
        print(
            f"{k:>4}  {loss:<8.4f}  {s['seconds']:>7.1f}  {s['fwd_bwd']:>7.1f}  {s['step']:>4.0f}"
            f"  {s['read'] / 1e9:>8.2f}  {s['written'] / 1e9:>11.2f}"
            f"  {s['read_wait']:>12.1f} / {s['write_wait']:<9.1f}  {io:>17.1f}"
            f"  {s['io_busy']:>11.1f}  {100 * io / s['io_busy']:>13.0f}%"
            f"  {s['seconds'] - blocked:>15.1f}"
        )
    last = r["steps"][-1]
    moved = (last["read"] + last["written"]) / last["seconds"]
    floor = last["read"] / read_rate + last["written"] / write_rate
    print(f"last step: {moved / 1e6:.0f} MB/s moved on average; the I/O alone at dd rate takes "
          f"{floor:.1f} s = {100 * floor / last['seconds']:.0f}% of the step and "
          f"{100 * floor / last['io_busy']:.0f}% of the {last['io_busy']:.1f} s with I/O in "
          "flight (the I/O time spent at dd's rate)")  # fmt: skip
    falling = r["losses"][-1] < r["losses"][0]
    print(f"loss {'falls' if falling else 'does NOT fall'}: {r['losses'][0]:.4f} -> "
          f"{r['losses'][-1]:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
