"""Gradient compression: bytes per step saved, and C++ kernels against the PyTorch reference.

Run from the repository root::

    .venv/bin/python benchmarks/comm_compression.py                  # 2 processes, 1 Mi elements
    .venv/bin/python benchmarks/comm_compression.py --numel 262144 --world-size 4 --json out.json

Part 1 (gloo, ``--world-size`` processes): one call of each collective on ``--numel`` fp32
elements, inside a :class:`minispeed.comm.CommsLogger`. The table shows the bytes this rank put on
the wire as the *logger* counted them, the formula of :mod:`minispeed.comm.compression.wire`
(they must agree), the saving against the fp32 collective that does the same job, and the best
time of ``--rounds``. Expected: 1-bit ~32x fewer than an fp32 all-reduce (plus one 4-byte scale
per rank per hop), top-1 % ~50x, int8 ~3.9x and int4 ~7.8x against fp32 all-gather /
reduce-scatter.

Part 2 (this process, one thread for both sides): throughput of each kernel on ``--numel`` fp32
elements, the C++ op at every compiled SIMD level against the pure-PyTorch reference, in one run,
as GB/s of fp32 input (output for unpack) and the speed-up over the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

import torch
from rich.console import Console
from rich.table import Table
from timing import best_time

import minispeed.comm as comm
from minispeed.comm.compression import (
    BlockQuantizer,
    OnebitAllReduce,
    TopkAllReduce,
    TopkCompressor,
    ops,
    quantized_all_gather_into_tensor,
    quantized_reduce_scatter_tensor,
    wire,
)
from minispeed.comm.compression import reference as ref
from minispeed.core.testing import run_distributed, shutdown_pool

LEVELS = {0: "scalar", 1: "avx2", 2: "avx512"}


# -- part 1: bytes on the wire ------------------------------------------------------------------
def _wire_body(rank: int, world_size: int, numel: int, rounds: int) -> list[dict]:
    torch.manual_seed(rank)
    n, shard = world_size, numel // world_size
    x = torch.randn(numel)
    topk = TopkCompressor(ratio=0.01)
    int8, int4 = BlockQuantizer(8, 256), BlockQuantizer(4, 256)
    onebit, top = OnebitAllReduce(), TopkAllReduce(topk)
    gathered, part = torch.empty(n * shard), torch.empty(shard)
    cases = [
        # name, baseline, call, formula
        ("fp32 all_reduce", None, lambda: comm.all_reduce(x.clone()),
         wire.dense_allreduce_calls(numel, n)),
        ("1-bit all-reduce", "fp32 all_reduce", lambda: onebit(x.clone()),
         wire.onebit_allreduce_calls(numel, n)),
        ("top-1% all-reduce", "fp32 all_reduce", lambda: top(x.clone()),
         wire.topk_allreduce_calls(numel, n, topk)),
        ("fp32 all_gather", None, lambda: comm.all_gather_into_tensor(gathered, x[:shard]),
         [("all_gather", 4 * n * shard)]),
        ("int8 all-gather (qwZ)", "fp32 all_gather",
         lambda: quantized_all_gather_into_tensor(gathered, x[:shard], quantizer=int8),
         wire.quantized_all_gather_calls(shard, n, int8)),
        ("int4 all-gather (qwZ)", "fp32 all_gather",
         lambda: quantized_all_gather_into_tensor(gathered, x[:shard], quantizer=int4),
         wire.quantized_all_gather_calls(shard, n, int4)),
        ("fp32 reduce_scatter", None, lambda: comm.reduce_scatter_tensor(part, x[: n * shard]),
         [("reduce_scatter", 4 * n * shard)]),
        ("int8 reduce-scatter (qgZ)", "fp32 reduce_scatter",
         lambda: quantized_reduce_scatter_tensor(part, x[: n * shard], quantizer=int8),
         wire.quantized_reduce_scatter_calls(shard, n, int8)),
        ("int4 reduce-scatter (qgZ)", "fp32 reduce_scatter",
         lambda: quantized_reduce_scatter_tensor(part, x[: n * shard], quantizer=int4),
         wire.quantized_reduce_scatter_calls(shard, n, int4)),
    ]  # fmt: skip
    rows = []
    for name, baseline, call, calls in cases:
        call()  # warm-up (and the compressors' residuals)
        with comm.CommsLogger() as log:
            call()
        comm.barrier()
        seconds = best_time(call, rounds)
        rows.append(
            {
                "name": name,
                "baseline": baseline,
                "logged_wire_bytes": log.total_wire_bytes(),
                "logged_msg_bytes": log.total_msg_bytes(),
                "formula_wire_bytes": wire.wire_bytes(calls, n),
                "time_s": seconds,
            }
        )
    return rows


# -- part 2: kernel throughput -------------------------------------------------------------------
def _kernel_rows(numel: int, rounds: int) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(numel)
    op = ops.load_op("cpu")
    chunk, block, k = 2048, 256, numel // 100
    bits, scales = ref.sign_pack(x, chunk)
    q8, s8 = ref.quantize_blocks(x, block, 8)
    q4, s4 = ref.quantize_blocks(x, block, 4)
    kernels = {
        "sign_pack": (lambda m, *lv: m.sign_pack(x, chunk, *lv)),
        "sign_unpack": (lambda m, *lv: m.sign_unpack(bits, scales, chunk, numel, *lv)),
        "quantize int8": (lambda m, *lv: m.quantize_blocks(x, block, 8, *lv)),
        "dequantize int8": (lambda m, *lv: m.dequantize_blocks(q8, s8, block, 8, numel, *lv)),
        "quantize int4": (lambda m, *lv: m.quantize_blocks(x, block, 4, *lv)),
        "dequantize int4": (lambda m, *lv: m.dequantize_blocks(q4, s4, block, 4, numel, *lv)),
        "topk_select 1%": (lambda m, *lv: m.topk_select(x, k, *lv)),
    }
    rows = []
    for name, run in kernels.items():
        reference_s = best_time(lambda run=run: run(ref), rounds)
        row = {"kernel": name, "numel": numel, "time_s[reference]": reference_s}
        for level in op.simd_levels() if op is not None else []:
            row[f"time_s[{LEVELS[level]}]"] = best_time(
                lambda run=run, level=level: run(op, level), rounds
            )
        rows.append(row)
    return rows


def _write_json(path: str, payload: dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    return f"{n:,.1f} TiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--numel", type=int, default=1 << 20, help="fp32 elements per call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write every row to this JSON file (atomically)")
    args = parser.parse_args(argv)
    if args.numel < 100 * args.world_size:
        parser.error("--numel must be at least 100 per rank")
    console = Console(width=150)

    ops.load_op("cpu")  # build once here, so the ranks load the cached op
    wire_rows = run_distributed(
        _wire_body, world_size=args.world_size, args=(args.numel, args.rounds), timeout_s=600
    )[0]
    shutdown_pool()
    by_name = {r["name"]: r for r in wire_rows}
    table = Table(
        title=f"bytes one rank sends per call: {args.numel:,} fp32 elements, "
        f"{args.world_size} gloo processes (rank 0's comms log)"
    )
    for col in ("collective", "wire (logged)", "wire (formula)", "fewer bytes than", "x", "time"):
        table.add_column(
            col, justify="left" if col in ("collective", "fewer bytes than") else "right"
        )
    for r in wire_rows:
        base = by_name.get(r["baseline"])
        ratio = base["logged_wire_bytes"] / r["logged_wire_bytes"] if base else None
        table.add_row(
            r["name"],
            _fmt_bytes(r["logged_wire_bytes"]),
            _fmt_bytes(r["formula_wire_bytes"]),
            r["baseline"] or "",
            f"{ratio:.1f}x" if ratio else "",
            f"{r['time_s'] * 1e3:,.2f} ms",
        )
    console.print(table)

    torch.set_num_threads(1)  # the op is single-threaded; so is the reference here
    kernel_rows = _kernel_rows(args.numel, args.rounds)
    levels = [c for c in kernel_rows[0] if c.startswith("time_s[") and c != "time_s[reference]"]
    ktable = Table(
        title=f"kernel throughput, {args.numel:,} fp32 elements, 1 thread (GB/s of fp32)"
    )
    ktable.add_column("kernel")
    for col in ["reference", *(c[7:-1] for c in levels), "best / reference"]:
        ktable.add_column(col, justify="right")
    for r in kernel_rows:
        gbps = [4 * r["numel"] / r[c] / 1e9 for c in ["time_s[reference]", *levels]]
        best = min((r[c] for c in levels), default=r["time_s[reference]"])
        ktable.add_row(
            r["kernel"], *(f"{v:.2f}" for v in gbps), f"{r['time_s[reference]'] / best:.1f}x"
        )
    console.print(ktable)

    if args.json:
        meta = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "world_size": args.world_size,
            "numel": args.numel,
        }
        _write_json(args.json, {"meta": meta, "wire": wire_rows, "kernels": kernel_rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
