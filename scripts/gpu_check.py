"""`make gpu-check`: prove every CUDA path of minispeed on one GPU, in one command, in under 8 minutes.

```bash
make gpu-check                                   # $OUT (or ./gpu-check-out) gets the results
python3 scripts/gpu_check.py --out DIR           # the same, by hand
python3 scripts/gpu_check.py --only op.cast,op.inference --out DIR
python3 scripts/gpu_check.py --dry-run --out DIR # on a machine without a GPU: CPU, tiny sizes
```

It writes `gpu_check.json` (every measurement, error and traceback; rewritten after every
check, so a run cut short still returns what finished), `gpu_check.md` (one table, also printed
last) and `gpu_check.log` (the workers' output, build logs included) under the output folder.
The checks are listed, with their time budgets, in `scripts/gpucheck/__init__.py`; what each
one measures is in its module's docstring and in docs/benchmarks.md ("GPU check").

How it runs: this driver imports nothing but the standard library. It starts a worker process
(`scripts/gpucheck/worker.py`) that runs the checks in order and reports each one's start and
result in a progress file. A check that raises is recorded by the worker (error and traceback)
and the next one runs; a check that crashes the worker, or outlives its budget (killed with its
process group), is recorded here, and a fresh worker runs the rest. No check starts when less
than it needs is left of the run's budget (`--budget-s`, 450 s by default); those are listed as
"not run".

On the device machine (python3 with CUDA torch, no network) nothing is installed: when
`minispeed` is not importable, every package's `src/` goes on `PYTHONPATH` (an editable pip
install would need hatchling, which that image lacks, and a registry). Each op is JIT-built by its
own builder for the GPU found (`-gencode` for its compute capability; `TORCH_CUDA_ARCH_LIST` set
to match), in parallel, and its build time recorded. Without a GPU the same run is the dry run:
tiny sizes, ops disabled (`MINISPEED_DISABLE_OPS=all`, nothing compiles), CUDA-only parts
reported as "skipped: no GPU".
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
sys.path.insert(0, str(SCRIPTS))

from gpucheck import CHECKS, FAULT_CHECKS, spec_of  # noqa: E402
from gpucheck.report import summary, write_outputs  # noqa: E402
from gpucheck.worker import POISONED  # noqa: E402

GRACE_S = 20.0  # a check running when the run's budget ends gets this much more, then is killed
BAD = ("fail", "error", "crashed", "timeout")


def _src_paths() -> list[str]:
    return [str(REPO / "src"), *sorted(str(p) for p in REPO.glob("packages/*/src"))]


def _commit() -> str | None:
    """The checkout's commit, when it is a git checkout (a device machine's copy may not be)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                             capture_output=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def worker_env(dry_run: bool) -> tuple[dict[str, str], str]:
    """The workers' environment, and how minispeed is found (installed, or src/ on the path)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(SCRIPTS)]
    try:
        spec = importlib.util.find_spec("minispeed.core")
    except ModuleNotFoundError:  # no "minispeed" namespace at all (the device image)
        spec = None
    if spec is None:
        paths += _src_paths()
        how = "src/ of every package on PYTHONPATH (no install)"
    else:
        how = f"installed ({Path(spec.origin).parent})"
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if dry_run:
        env["MINISPEED_ACCELERATOR"] = "cpu"
    return env, how


class Run:
    """The checks' results so far, written out after every change."""

    def __init__(self, out: Path, order: list[str], budget_s: float, meta: dict) -> None:
        self.out, self.order, self.budget_s = out, order, budget_s
        self.results: dict[str, dict] = {}
        self.meta = meta
        self.t0 = time.time()
        self.deadline = self.t0 + budget_s
        self.dry_run: bool | None = meta.get("dry_run")

    def record(self, name: str, result: dict) -> None:
        self.results[name] = result
        facts = result.get("facts", {}) if name == "env" else {}
        for key in ("torch", "cuda", "device", "nvcc"):
            if key in facts:
                self.meta[key] = facts[key]
        self.write()
        extra = f": {result['error'].splitlines()[0][:200]}" if result.get("error") else ""
        print(
            f"[{time.time() - self.t0:5.0f} s] {name}: {result['status']} "
            f"({result.get('seconds', 0):.1f} s){extra}",
            flush=True,
        )

    def write(self) -> str:
        self.meta["elapsed_s"] = round(time.time() - self.t0, 1)
        return write_outputs(self.out, self.meta, self.results, self.order)

    def budget_of(self, name: str) -> float:
        spec = spec_of(name)
        return spec.dry_budget_s if self.dry_run else spec.budget_s


def _read_events(path: Path, pos: int) -> tuple[list[dict], int]:
    """Complete JSON lines of the progress file after byte `pos`."""
    if not path.exists():
        return [], pos
    with path.open("rb") as f:
        f.seek(pos)
        data = f.read()
    end = data.rfind(b"\n") + 1
    events = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return events, pos + end


def _tail(path: Path, start: int, chars: int = 3000) -> str:
    with path.open("rb") as f:
        f.seek(start)
        return f.read().decode("utf-8", "replace")[-chars:]


def _kill(proc: subprocess.Popen) -> None:
    """End the worker and everything it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_workers(run: Run, env: dict[str, str], scratch: Path, log_path: Path, dry_run: bool):
    pending = list(run.order)
    attempt = 0
    while pending:
        if time.time() >= run.deadline:
            for name in pending:
                run.record(name, {"status": "not run", "seconds": 0.0,
                                  "error": f"the run's budget of {run.budget_s:.0f} s ran out"})  # fmt: skip
            return
        attempt += 1
        progress = scratch / f"progress-{attempt}.jsonl"
        cmd = [sys.executable, "-u", "-m", "gpucheck.worker", "--checks", ",".join(pending),
               "--progress", str(progress), "--scratch", str(scratch / "work"),
               "--deadline", str(run.deadline)] + (["--dry-run"] if dry_run else [])  # fmt: skip
        with log_path.open("ab") as log:
            log_start = log.tell()
            log.write(f"\n=== worker {attempt}: {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        pos, current, started, progressed = 0, None, 0.0, False
        while True:
            events, pos = _read_events(progress, pos)
            for e in events:
                if e["event"] == "hello":
                    run.dry_run = e["dry_run"]
                    run.meta.update(dry_run=e["dry_run"], device=e["device"],
                                    mode="dry run on CPU" if e["dry_run"] else "GPU")  # fmt: skip
                elif e["event"] == "start":
                    current, started, progressed = e["check"], time.time(), True
                elif e["event"] == "done":
                    run.record(e["check"], e["result"])
                    pending.remove(e["check"])
                    current, progressed = None, True
            rc = proc.poll()
            if rc is not None:
                events, pos = _read_events(progress, pos)
                for e in events:
                    if e["event"] == "done":
                        run.record(e["check"], e["result"])
                        pending.remove(e["check"])
                        current = None if e["check"] == current else current
                if current is not None:
                    why = f"the worker died (exit status {rc}) inside this check; log tail:\n"
                    run.record(current, {"status": "crashed", "seconds": time.time() - started,
                                         "error": why + _tail(log_path, log_start)})  # fmt: skip
                    pending.remove(current)
                elif pending and (rc not in (0, POISONED) or not progressed):
                    for name in pending:  # a worker that cannot start would fail again
                        run.record(name, {"status": "error", "seconds": 0.0,
                                          "error": f"worker exited {rc} before this check; log "
                                          f"tail:\n{_tail(log_path, log_start)}"})  # fmt: skip
                    pending.clear()
                break
            if current is not None:
                limit = min(started + run.budget_of(current), run.deadline + GRACE_S)
                if time.time() > limit:
                    _kill(proc)
                    events, pos = _read_events(progress, pos)
                    for e in events:
                        if e["event"] == "done":
                            run.record(e["check"], e["result"])
                            pending.remove(e["check"])
                    if current in pending:
                        run.record(current, {"status": "timeout", "seconds": time.time() - started,
                                             "error": f"killed after {time.time() - started:.0f} s "
                                             f"(budget {run.budget_of(current):.0f} s); log tail:\n"
                                             + _tail(log_path, log_start, 1500)})  # fmt: skip
                        pending.remove(current)
                    break
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: $OUT, else ./gpu-check-out)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny sizes, ops disabled (the default without a GPU)")  # fmt: skip
    parser.add_argument("--only", default="", help="comma-separated checks to run, in order")
    parser.add_argument("--skip", default="", help="comma-separated checks to leave out")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="the whole run's budget in seconds (default 450)")  # fmt: skip
    parser.add_argument("--keep-scratch", action="store_true",
                        help="keep the scratch folder (built libraries, captures)")  # fmt: skip
    args = parser.parse_args(argv)

    out = args.out or Path(os.environ.get("OUT") or REPO / "gpu-check-out")
    if args.only:
        order = [spec_of(n).name for n in args.only.split(",") if n]
    else:
        order = [s.name for s in CHECKS]
    skip = {spec_of(n).name for n in args.skip.split(",") if n}
    order = [n for n in order if n not in skip]
    env, how = worker_env(args.dry_run)
    meta = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "budget_s": args.budget_s,
        "minispeed": how,
        "commit": _commit(),
        "python": sys.version.split()[0],
        "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "checks_known": [s.name for s in CHECKS + FAULT_CHECKS],
    }
    if args.dry_run:
        meta.update(dry_run=True, mode="dry run on CPU")
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "gpu_check.log"
    log_path.write_text("")
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    run = Run(out, order, args.budget_s, meta)
    print(f"gpu_check: {len(order)} checks, budget {args.budget_s:.0f} s, minispeed {how}; "
          f"results in {out}", flush=True)  # fmt: skip
    try:
        run_workers(run, env, scratch, log_path, args.dry_run)
    finally:
        table = run.write()
        if not args.keep_scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    print("\n" + table + "\n" + summary(run.results, run.order), flush=True)
    bad = [n for n, r in run.results.items() if r["status"] in BAD]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
