"""Run short 2-rank jobs back to back under a CPU load and count how each rank exits.

    python scripts/stress_exit.py --runs 50 --load 4
    python scripts/stress_exit.py --runs 10 --cases zero1,zero3-trace --load 2 --keep /tmp/aborts

An abort at exit (`terminate called without an active exception`, SIGABRT, exit -6) after a
run that trained correctly is intermittent and more frequent on a loaded machine, so one run
proves nothing: this script repeats each case, with `--load` busy processes competing for the
cores, and prints per case how many runs ended cleanly, how many aborted and how many failed
otherwise (a line as each round of the cases ends; Ctrl-C stops it and prints the counts of
the runs finished, those in flight ending uncounted). It exits 1 when any run did not end cleanly. The cases:

- `zero1`, `zero3`: a ZeRO step (`zero.shard`, stage 1 or 3) on 2 ranks started as torchrun
  would (`RANK`, `WORLD_SIZE`, ...), whose script calls `opt.close()` and
  `comm.destroy_process_group()` itself;
- `zero1-trace`, `zero3-trace`: the same script under `python -m minispeed.profiler trace
  --nproc 2` (each step in `profiler.traced_step()`, step 1 recorded);
- `engine1`, `engine3`: a DeepSpeed-style script (`minispeed.engine.initialize` with
  `model_parameters` and a ds_config, a few steps, no teardown of its own) under torchrun;
- `comm`: the smallest case, `minispeed.comm` alone: collectives on tensors the script drops
  at once, sync and async, then the end of the script (what the suite runs, `--parallel 5`).

Every rank runs with `PYTHONFAULTHANDLER=1`, so an abort prints every Python thread's stack;
`--keep DIR` keeps the output of each run that did not end cleanly; `--parallel P` starts P
runs at a time (a load of their own). What the harness found is Note [the backend lets go
before we do] in `packages/comm/src/minispeed/comm/handoff.py`. `--worker` is this
script's own rank program (what the cases run), not meant to be called by hand.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("zero1", "zero3", "zero1-trace", "zero3-trace", "engine1", "engine3", "comm")
ABORT_TEXTS = ("terminate called", "Fatal Python error: Aborted", "SIGABRT", "exited with -6")


def comm_worker(steps: int) -> None:
    """One rank of `comm`: collectives on temporaries, then the end of the script."""
    import torch

    import minispeed.comm as comm

    comm.init_distributed()
    for _ in range(10 * steps):
        comm.all_reduce(torch.ones(256))
        comm.all_gather_into_tensor(torch.empty(512), torch.ones(256))
        comm.all_reduce(torch.ones(256), async_op=True).wait()


def worker(stage: int, engine: bool, steps: int) -> None:
    """One rank's program: a few training steps of a small GPT, then the script's own end."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    if engine:  # DeepSpeed's usual script: no teardown, the process just ends
        import minispeed.engine as deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage},
        }
        engine_, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        g = torch.Generator().manual_seed(int(os.environ["RANK"]))
        for _ in range(steps):
            idx = torch.randint(0, 64, (4, 17), generator=g)
            _, loss = engine_(idx[:, :-1], idx[:, 1:])
            engine_.backward(loss)
            engine_.step()
        return
    import minispeed.comm as comm
    import minispeed.zero as zero
    from minispeed import profiler

    comm.init_distributed()
    config = zero.ZeroConfig(stage=stage, stage3_param_persistence_threshold_numel=0)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    g = torch.Generator().manual_seed(comm.get_rank())
    for _ in range(steps):
        with profiler.traced_step():  # a no-op unless run under `trace`
            idx = torch.randint(0, 64, (4, 17), generator=g)
            _, loss = model(idx[:, :-1], idx[:, 1:])
            opt.backward(loss)
            opt.step()
    opt.close()
    comm.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_argv(case: str, steps: int) -> list[str]:
    argv = [str(Path(__file__).resolve()), "--worker", "--steps", str(steps)]
    if case == "comm":
        return [*argv, "--stage", "-1"]
    stage = case[len("zero") :][0] if case.startswith("zero") else case[len("engine") :]
    return [*argv, "--stage", stage, *(["--engine"] if case.startswith("engine") else [])]


def run_case(case: str, steps: int, timeout_s: float) -> tuple[str, str]:
    """Run `case` once; return (outcome, output): outcome is "ok", "abort" or "fail:<why>"."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    worker_argv = _worker_argv(case, steps)
    if case.endswith("-trace"):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "minispeed.profiler", "trace", "--nproc", "2",
                   "--out", str(Path(tmp) / "t.json"), *worker_argv]  # fmt: skip
            return _collect([_start(cmd, env)], timeout_s)
    if case.startswith("engine"):  # as a user launches a DeepSpeed script
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", *worker_argv]  # fmt: skip
        return _collect([_start(cmd, env)], timeout_s)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                        LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
        procs.append(_start([sys.executable, *worker_argv], rank_env))
    return _collect(procs, timeout_s)


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _collect(procs: list[subprocess.Popen], timeout_s: float) -> tuple[str, str]:
    deadline = time.monotonic() + timeout_s
    outs, codes = [], []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            outs.append(out)
            return "fail:timeout", "\n".join(outs)
        outs.append(out)
        codes.append(p.returncode)
    text = "\n".join(outs)
    if any(t in text for t in ABORT_TEXTS) or -signal.SIGABRT in codes:
        return "abort", text
    if any(codes):
        return f"fail:exit {codes}", text
    return "ok", text


def _busy() -> None:
    while True:
        sum(i * i for i in range(10_000))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each case")
    parser.add_argument("--cases", default=",".join(CASES), help=f"from {', '.join(CASES)}")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the runs")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run")
    parser.add_argument("--keep", type=Path, help="write the output of each bad run here")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.stage < 0:
            comm_worker(args.steps)
        else:
            worker(args.stage, args.engine, args.steps)
        return 0
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    import multiprocessing

    load = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for p in load:
        p.start()
    counts: dict[str, Counter] = {c: Counter() for c in cases}
    start = time.monotonic()
    jobs = [(i, case) for i in range(args.runs) for case in cases]
    pool = ThreadPoolExecutor(args.parallel)
    stopped = ""
    try:
        done = pool.map(lambda job: (*job, *run_case(job[1], args.steps, args.timeout)), jobs)
        for k, (i, case, outcome, text) in enumerate(done, 1):
            counts[case][outcome] += 1
            if outcome != "ok":
                print(f"run {i} {case}: {outcome}", flush=True)
                if args.keep:
                    (args.keep / f"{case}_{i}.log").write_text(text)
            if k % len(cases) == 0:
                print(f"{k // len(cases)} of {args.runs} rounds done", flush=True)
    except KeyboardInterrupt:  # the counts so far; the runs in flight end, none starts
        stopped = " (interrupted: the runs finished so far)"
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for p in load:
            p.kill()
    print(f"{args.runs} runs per case{stopped}, load {args.load}, "
          f"{time.monotonic() - start:.0f} s, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    bad = 0
    for case, c in counts.items():
        bad += sum(n for o, n in c.items() if o != "ok")
        print(f"{case:12s} ok {c['ok']:4d}  abort {c['abort']:4d}  other "
              f"{sum(n for o, n in c.items() if o not in ('ok', 'abort')):4d}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
