"""`python -m minispeed.profiler {trace,calibrate}`.

    python -m minispeed.profiler trace --nproc 2 --out step.json SCRIPT.py [script args...]
    python -m minispeed.profiler calibrate [--nproc 2] [--out FILE] [--no-links]

`trace` runs SCRIPT on `--nproc` local ranks (torchrun's variables), records the step numbered
`--step` that the script wraps in `minispeed.profiler.traced_step()`, and merges the ranks into
one Chrome trace (open it at https://ui.perfetto.dev). `calibrate` measures what the
performance model needs and writes it where `perf_model.Machine.load()` finds it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from minispeed.core.files import atomic_write_json
from minispeed.profiler.launch import launch
from minispeed.profiler.perf_model import CALIBRATION_FILE
from minispeed.profiler.timeline import TRACE_DIR_ENV, TRACE_STEP_ENV, merge_traces, track_names


def _trace(args: argparse.Namespace) -> None:
    script = Path(args.script)
    if not script.exists():
        raise SystemExit(f"trace: script {script} not found")
    with tempfile.TemporaryDirectory() as tmp:
        env = {TRACE_DIR_ENV: tmp, TRACE_STEP_ENV: str(args.step), "OMP_NUM_THREADS": "1"}
        launch([sys.executable, str(script), *args.script_args], args.nproc, env, args.timeout)
        files = [Path(tmp) / f"rank{r}.json" for r in range(args.nproc)]
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise SystemExit(
                f"trace: no trace from {missing}: the script must wrap at least {args.step + 1} "
                "steps in minispeed.profiler.traced_step() (or pass a smaller --step)"
            )
        trace = merge_traces(files, args.out)
    print(f"wrote {args.out}: {args.nproc} ranks; tracks of rank 0: {track_names(trace, 0)}")
    print("open it at https://ui.perfetto.dev (or chrome://tracing)")


def _calibrate(args: argparse.Namespace) -> None:
    from minispeed.profiler.calibrate import calibrate

    machine = calibrate(nproc=args.nproc, links=not args.no_links)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, machine.to_json())  # a complete file or the old one
    for n, f in sorted(machine.matmul_flops_per_s.items()):
        print(f"matmul {n}x{n}: {f / 1e9:.1f} GFLOP/s")
    print(f"element-wise memory rate: {machine.stream_bytes_per_s / 1e9:.2f} GB/s")
    if machine.dram_bytes_per_s:
        print(f"DRAM rate (64 MB copy, read + write): {machine.dram_bytes_per_s / 1e9:.2f} GB/s")
    print(f"operator call: {machine.op_overhead_s * 1e6:.1f} us")
    if machine.adam_s_per_param:
        print(
            f"AdamW step: {machine.adam_s_per_param * 1e9:.1f} ns per parameter "
            f"+ {machine.adam_s_per_tensor * 1e6:.0f} us per tensor"
        )
    print(f"gradient hook: {machine.hook_s_per_grad * 1e6:.0f} us per gradient")
    for op, link in machine.links.items():
        print(
            f"{op}: alpha {link.alpha_s * 1e6:.0f} us, busbw {link.busbw_bytes_per_s / 1e9:.2f} GB/s"
        )
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run the command."""
    parser = argparse.ArgumentParser(
        prog="python -m minispeed.profiler", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace", help="one step of SCRIPT across ranks as a Chrome trace")
    t.add_argument("--nproc", type=int, default=2)
    t.add_argument("--out", default="trace.json")
    t.add_argument("--step", type=int, default=1, help="which traced_step() to record (0-based)")
    t.add_argument("--timeout", type=float, default=300)
    t.add_argument("script")
    t.add_argument("script_args", nargs=argparse.REMAINDER)
    c = sub.add_parser("calibrate", help="measure matmul FLOP/s and collective costs")
    c.add_argument("--nproc", type=int, default=2)
    c.add_argument("--out", default=str(CALIBRATION_FILE))
    c.add_argument("--no-links", action="store_true", help="matmul only (no minispeed-comm needed)")
    args = parser.parse_args(argv)
    {"trace": _trace, "calibrate": _calibrate}[args.command](args)


if __name__ == "__main__":
    main()
