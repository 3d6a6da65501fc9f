"""Where a stage-3 step's minor page faults come from: per phase and per op, against the floor.

Counts, not times (issue 34 point 1). Two gloo processes build the named contenders of
`zero_vs_torch.py` in one process each, as its rounds do (the same GPT, keys and batches:
`zerobench.contenders.build`), run `--warmup` steps of each, then `--steps` steps each, in turns.
Per phase (forward, backward, optimizer step) it reports the process's minor page faults
(`getrusage(RUSAGE_SELF).ru_minflt`, every thread) and CPU time, all threads and the main
thread's own (`time.thread_time`: the rest is gloo's threads). Unless `--no-ledger`, a
`TorchDispatchMode` also reads, around every tensor op, the faults (all threads; the main
thread's), glibc's mmapped bytes (`mallinfo2().hblkhd`) and arena bytes, and charges them to
(phase, op, the innermost frame of ours on the stack). A fault is charged to whichever op first
touches a page the kernel had not mapped, not to the code that freed it, and a fault taken by a
gloo thread lands on the op the main thread was running then (the `main` column says which
share is the main thread's own). With `FAULTS_MARK=1` each phase starts with a `stat` of
`/tmp/mark-<contender>-<phase>-<rank>`, so that `strace -f -e trace=brk,mmap,munmap,newfstatat`
attributes the heap's growth and trims to phases. With `--cpu` the ledger charges the main
thread's CPU time inside each op instead (`time.thread_time` around it; what the ledger's own
Python costs falls between ops and is not charged): where a step's tensor work goes, op by op,
against the floor's.

```bash
.venv/bin/python benchmarks/stage3_faults.py --contender "torch FSDP2" ZeRO-3 "floor (no communication)"
.venv/bin/python benchmarks/stage3_faults.py --contender ZeRO-3 "floor (no communication)" \
    "ZeRO-3 limit - floor" --no-ledger --warmup 1 --steps 4
.venv/bin/python benchmarks/stage3_faults.py --contender ZeRO-3 "floor (no communication)" --cpu \
    --warmup 1 --steps 2 --top 45
```
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from zerobench.contenders import SIZES, build, size_args  # noqa: E402
from zerobench.heap import _MallInfo2  # noqa: E402
from zerobench.ranks import run_ranks  # noqa: E402
from zerobench.rounds import global_batches  # noqa: E402

RUSAGE_THREAD = 1  # Linux: the calling thread only


def _faults(who: int = resource.RUSAGE_SELF) -> int:
    return resource.getrusage(who).ru_minflt


def _where() -> str:
    """The innermost frame of our packages (minispeed) on the stack, else the benchmark's."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        f = frame.filename
        if "/minispeed/" in f:
            return f"{Path(f).name}:{frame.name}"
    return "model / autograd"


class FaultLedger(TorchDispatchMode):
    """Minor faults (all threads; main thread) and mmapped bytes added, per (phase, op, where);
    with ``cpu``, the main thread's CPU microseconds inside each op (column 0) instead."""

    def __init__(self, cpu: bool = False) -> None:
        super().__init__()
        self.cpu = cpu
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        self.mallinfo = libc.mallinfo2
        self.phase = "forward"
        self.rows: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0, 0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.cpu:
            t0 = time.thread_time()
            out = func(*args, **(kwargs or {}))
            row = self.rows[(self.phase, func.__name__, _where())]
            row[0] += (time.thread_time() - t0) * 1e6
            row[3] += 1
            return out
        m0 = self.mallinfo()
        f0, t0 = _faults(), _faults(RUSAGE_THREAD)
        out = func(*args, **(kwargs or {}))
        df, dt = _faults() - f0, _faults(RUSAGE_THREAD) - t0
        m1 = self.mallinfo()
        dh, da = m1.hblkhd - m0.hblkhd, m1.arena - m0.arena
        if df or dh or da:
            row = self.rows[(self.phase, func.__name__, _where())]
            row[0] += df
            row[1] += dt
            row[2] += max(dh, 0)
            row[3] += 1
            row[4] += max(da, 0)
            row[5] += max(-da, 0)
        return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), MINISPEED_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from data import CharDataset

    import minispeed.comm as comm

    comm.init_distributed(backend="gloo")
    dataset = CharDataset.from_file()
    names = args.contender
    batches = global_batches(args, dataset, rank, world, args.warmup + args.steps)
    # As zero_vs_torch.py's rounds: every contender built in this process, then taking turns.
    trainers = {n: build(n, args, dataset.tokenizer.vocab_size) for n in names}
    for name in names:
        for x, y in batches[: args.warmup]:
            trainers[name].step(x, y)
    ledgers = {n: FaultLedger(args.cpu) for n in names}
    phases = {n: collections.Counter() for n in names}
    cpu = {n: collections.Counter() for n in names}  # (phase, "all"/"main") -> CPU seconds
    per_step = {n: [] for n in names}
    for x, y in batches[args.warmup :]:
        for name in names:
            trainer, ledger = trainers[name], ledgers[name]
            dist.barrier()
            total = 0
            with ledger if args.ledger else contextlib.nullcontext():
                for phase in ("forward", "backward", "step"):
                    ledger.phase = phase
                    if os.environ.get("FAULTS_MARK"):  # for strace -e newfstatat: phase markers
                        os.path.exists(f"/tmp/mark-{name.split()[0]}-{phase}-{rank}")
                    f0, c0, m0 = _faults(), time.process_time(), time.thread_time()
                    if phase == "forward":
                        loss = trainer.forward(x, y)
                    elif phase == "backward":
                        trainer.backward(loss)
                    else:
                        trainer.optimizer_step()
                    phases[name][phase] += _faults() - f0
                    cpu[name][phase, "all"] += time.process_time() - c0
                    cpu[name][phase, "main"] += time.thread_time() - m0
                    total += _faults() - f0
            per_step[name].append(total)
    out = {
        n: {
            "phases": {k: v / args.steps for k, v in phases[n].items()},
            "per_step": per_step[n],
            "cpu_ms": {f"{k[0]} {k[1]}": round(v / args.steps * 1e3, 1) for k, v in cpu[n].items()},
            "rows": dict(ledgers[n].rows),
        }
        for n in names
    }
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contender", nargs="+", default=["ZeRO-3", "floor (no communication)"])
    p.add_argument("--size", choices=sorted(SIZES), default="large")
    p.add_argument("--keys", default="deepspeed")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--checkpoint", action="store_true")
    p.add_argument("--no-ledger", dest="ledger", action="store_false", help="phases only")
    p.add_argument("--cpu", action="store_true", help="the ledger charges main-thread CPU µs")
    args = size_args(p.parse_args())
    results = run_ranks(_worker, 2, args)
    for name in args.contender:
        for rank in (0, 1):
            r = results[rank][name]
            print(
                f"\n== {name}, rank {rank}: faults per step by phase {r['phases']}; "
                f"steps {r['per_step']}\n   CPU ms per step, all threads / main thread: "
                f"{r['cpu_ms']}"
            )
        rows = results[0][name]["rows"]
        total = sum(v[0] for v in rows.values()) / args.steps
        unit = "µs of main-thread CPU in ops" if args.cpu else "faults"
        print(f"rank 0, per step: {total:.0f} {unit} under the ledger; top rows:")
        first = "CPU µs" if args.cpu else "faults"
        print(
            f"{'phase':9} {'op':34} {'where':44} {first:>8} {'main':>8} {'mmap MiB':>9} {'ops':>5} {'arena+':>7} {'arena-':>7}"
        )
        for (phase, op, where), (f, t, h, n, ag, ash) in sorted(
            rows.items(), key=lambda kv: -kv[1][0]
        )[: args.top]:
            s = args.steps
            print(
                f"{phase:9} {op[:34]:34} {where[:44]:44} {f / s:8.0f} {t / s:8.0f} "
                f"{h / s / 2**20:9.1f} {n / s:5.0f} {ag / s / 2**20:7.1f} {ash / s / 2**20:7.1f}"
            )


if __name__ == "__main__":
    main()
