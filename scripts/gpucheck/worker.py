"""A worker process: runs the checks it is given in order, each isolated, and says so line by line.

The driver (`scripts/gpu_check.py`) starts a worker with the checks still to run and reads its
progress file, one JSON object per line:

```text
{"event": "hello", "gpu": true, "dry_run": false, "device": "NVIDIA H200"}
{"event": "start", "check": "op.cast", "t": 1733000000.0}
{"event": "done", "check": "op.cast", "result": {...}}
```

An exception inside a check is caught here: its error and traceback are recorded and the next
check runs. What cannot be caught here is the driver's business: a crash (segfault, abort) ends
the worker mid-check, a hang outlives the check's budget and the driver kills it; either way the
driver records that check and starts a fresh worker for the rest. After an exception on a GPU
the worker also asks the device whether it still works (a kernel fault poisons the CUDA context
for every later call in the process) and, if not, exits with `POISONED` so a fresh process runs
the rest.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gpucheck import spec_of
from gpucheck.harness import Report

POISONED = 3  # exit status: the CUDA context is broken; run the remaining checks elsewhere


class Progress:
    """The progress file: append one JSON line per event, flushed at once."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def emit(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"event": event, **fields}, default=str) + "\n")
        self.file.flush()


def _resolve(target: str):
    module, _, fn = target.partition(":")
    return getattr(importlib.import_module(module), fn)


def _context_broken(ctx: Any) -> bool:
    """Whether the device still answers after a failed check (always False on the CPU)."""
    if ctx is None or not ctx.gpu:
        return False
    try:
        ctx.sync()
        return False
    except Exception:
        return True


def run(names: list[str], progress: Progress, scratch: Path, deadline: float, dry_run: bool):
    """Run `names` in order; returns the exit status (0, or `POISONED`)."""
    ctx = None
    if any(spec_of(n).needs_torch for n in names):
        from gpucheck.harness import Ctx

        ctx = Ctx(dry_run, scratch)
        if ctx.dry_run:  # nothing compiles in the dry run: every wrapper runs its reference
            os.environ.setdefault("MINISPEED_DISABLE_OPS", "all")
        device = "cpu"
        if ctx.gpu:  # build every op for exactly this GPU (torch's JIT reads it, so does nvcc)
            import torch

            major, minor = torch.cuda.get_device_capability(ctx.device)
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
            device = torch.cuda.get_device_name(ctx.device)
        progress.emit("hello", gpu=ctx.gpu, dry_run=ctx.dry_run, device=device)
    for name in names:
        spec = spec_of(name)
        left = deadline - time.time()
        if left < spec.need_s:
            result = {
                "status": "not run",
                "seconds": 0.0,
                "error": f"{left:.0f} s of the run's budget left, the check needs {spec.need_s:.0f}",
            }
            progress.emit("done", check=name, result=result)
            continue
        progress.emit("start", check=name, t=time.time())
        report = Report(name, dry_run=ctx.dry_run if ctx is not None else dry_run)
        t0 = time.perf_counter()
        error = tb = None
        try:
            _resolve(spec.target)(ctx, report)
            status = report.status()
        except Exception as err:
            status = "error"
            error = f"{type(err).__name__}: {err}".splitlines()[0][:400]
            tb = traceback.format_exc()[-6000:]
            print(f"[gpu_check] {name} raised:\n{tb}", file=sys.stderr, flush=True)
        result = {
            "status": status,
            "seconds": round(time.perf_counter() - t0, 2),
            **report.to_json(),
        }
        if error:
            result.update(error=error, traceback=tb)
        progress.emit("done", check=name, result=result)
        if ctx is not None:
            try:
                ctx.free()
            except Exception:
                pass
        if status == "error" and _context_broken(ctx):
            return POISONED
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gpu_check worker (started by the driver)")
    parser.add_argument("--checks", required=True, help="comma-separated check names, in order")
    parser.add_argument("--progress", type=Path, required=True)
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--deadline", type=float, required=True, help="epoch seconds")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    progress = Progress(args.progress)
    return run(args.checks.split(","), progress, args.scratch, args.deadline, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
