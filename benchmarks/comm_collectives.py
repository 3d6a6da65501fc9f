"""Bus bandwidth of each collective per message size on gloo, ours against plain torch.distributed.

Run from the repository root::

    .venv/bin/python benchmarks/comm_collectives.py                # 2 processes, default sizes
    .venv/bin/python benchmarks/comm_collectives.py --json out.json --sizes 256 65536
    .venv/bin/python benchmarks/comm_collectives.py --sizes   # overheads and checks only

Three variants run interleaved in one process group (see :mod:`minispeed.comm.benchmark`):
``torch`` (raw torch.distributed), ``comm`` (minispeed.comm, logger off) and ``comm+log``
(logger on). The ratios are our time over torch's: 1.00 means no overhead. Each time is the best
of ``--rounds`` rounds; on a shared or small machine the network numbers stay noisy, so a second
table measures our per-call overhead alone, on one-rank groups where nothing is sent. A third
times a small all-reduce under each cross-rank check mode (see minispeed.comm.handshake).
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

from minispeed.comm import benchmark
from minispeed.core.testing import run_distributed, shutdown_pool


def _body(rank: int, world_size: int, ops: tuple, sizes: tuple, rounds: int, rs: tuple) -> dict:
    if rs:  # only the reduce-scatter implementations
        return {"rs": benchmark.measure_reduce_scatter_impls(sizes=rs, rounds=rounds)}
    return {
        "checks": benchmark.measure_checks(rounds=rounds),
        "dispatch": benchmark.measure_dispatch(
            ops=tuple(op for op in ops if op in benchmark.OPS), rounds=rounds
        ),
        "rows": benchmark.measure(ops=ops, sizes=sizes, rounds=rounds) if sizes else [],
    }


def _fmt_size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} TiB"


def _print_rs(rows: list[dict], n: int) -> None:
    table = Table(title=f"in-place reduce-scatter on gloo, {n} processes, fp32 (per call)")
    cols = ["size", *(f"{k} {v}" for k in ("wall", "CPU") for v in benchmark.RS_IMPLS)]
    for col in [*cols, "ring/all_reduce wall", "ring/all_reduce CPU"]:
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            _fmt_size(r["msg_bytes"]),
            *(
                f"{r[f'{k}_s[{v}]'] * 1e3:.2f} ms"
                for k in ("wall", "cpu")
                for v in benchmark.RS_IMPLS
            ),
            f"{r['wall_s[ring_p2p]'] / r['wall_s[all_reduce]']:.2f}",
            f"{r['cpu_s[ring_p2p]'] / r['cpu_s[all_reduce]']:.2f}",
        )
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    every_op = [*benchmark.OPS, benchmark.IN_PLACE]
    parser.add_argument("--ops", nargs="+", default=every_op, choices=every_op)
    parser.add_argument(
        "--sizes", nargs="*", type=int, default=[1 << 8, 1 << 12, 1 << 16, 1 << 20],
        help="message sizes in fp32 elements (default: 1 KiB, 16 KiB, 256 KiB, 4 MiB); "
        "none (--sizes) skips the bandwidth table",
    )  # fmt: skip
    parser.add_argument(
        "--rs-impls", nargs="+", type=float, metavar="MiB", default=[],
        help="instead of the tables below, time an in-place fp32 reduce-scatter (ZeRO's call) of "
        "these sizes in MiB under each implementation on gloo: torch's, comm's all-reduce of the "
        "input, comm's ring over point-to-point (wall and CPU time)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this JSON file (atomically)")
    args = parser.parse_args(argv)
    rs = tuple(int(mib * (1 << 20)) // 4 for mib in args.rs_impls)

    result = run_distributed(
        _body,
        world_size=args.world_size,
        args=(tuple(args.ops), tuple(args.sizes), args.rounds, rs),
        timeout_s=600,
    )[0]
    if rs:
        shutdown_pool()
        _print_rs(result["rs"], args.world_size)
        return 0
    rows, dispatch, checks = result["rows"], result["dispatch"], result["checks"]
    shutdown_pool()

    table = Table(title=f"gloo, {args.world_size} processes, fp32, torch {torch.__version__}")
    cols = ["op", "size", "time torch", "busbw torch", "busbw comm", "busbw comm+log"]
    for col in [*cols, "comm/torch", "comm+log/torch"]:
        table.add_column(col, justify="left" if col == "op" else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            r["op"],
            _fmt_size(r["msg_bytes"]),
            f"{r['time_s[torch]'] * 1e6:,.0f} us",
            *(f"{r[f'busbw_GBps[{v}]'] * 1e3:,.1f} MB/s" for v in benchmark.VARIANTS),
            f"{r['ratio[comm/torch]']:.2f}",
            f"{r['ratio[comm+log/torch]']:.2f}",
        )
    console = Console(width=160)
    console.print(table)

    solo = Table(title="per-call cost on a one-rank group (no communication): our overhead")
    for col in ("op", "torch", "comm", "comm+log", "overhead comm", "overhead comm+log"):
        solo.add_column(col, justify="left" if col == "op" else "right", no_wrap=True)
    for d in dispatch:
        solo.add_row(
            d["op"],
            *(f"{d[f'us_per_call[{v}]']:.1f} us" for v in benchmark.VARIANTS),
            f"{d['overhead_us[comm]']:+.1f} us",
            f"{d['overhead_us[comm+log]']:+.1f} us",
        )
    console.print(solo)

    title = (
        f"cross-rank checks: one all_reduce of {checks['numel']} fp32 on {args.world_size} "
        "processes (steady state)"
    )
    check_table = Table(title=title)
    for col in ("checks", "per call", "/ off"):
        check_table.add_column(col, justify="left" if col == "checks" else "right")
    labels = {
        "off": "off (MINISPEED_COMM_VALIDATE=0)",
        "first": "first call of each site (default)",
        "all": "every call, fingerprint (=1)",
        "objects": "every call, pickled signatures (=1 before)",
    }
    for v in benchmark.CHECK_VARIANTS:
        check_table.add_row(
            labels[v], f"{checks[f'us_per_call[{v}]']:.1f} us", f"{checks[f'ratio[{v}/off]']:.2f}x"
        )
    console.print(check_table)
    console.print(
        f"one named range (comm.<op>) with nothing listening: {checks['range_us']:.3f} us"
    )

    if args.json:
        meta = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        }
        folder = os.path.dirname(os.path.abspath(args.json))
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(
                {"meta": meta, "rows": rows, "dispatch": dispatch, "checks": checks}, f, indent=1
            )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
