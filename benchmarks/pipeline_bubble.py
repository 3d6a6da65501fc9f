"""Measured bubble and activation memory of every minispeed schedule, against the formulas.

```bash
.venv/bin/python benchmarks/pipeline_bubble.py                 # P=2, M in 2 4 8
.venv/bin/python benchmarks/pipeline_bubble.py --stages 4 --micro-batches 4 8
```

For each schedule and micro-batch count M: the median measured bubble (1 − Σ busy / (P · step
time), busy from the executor's timeline), the formula's (`costs.bubble_fraction`, or the
zero-bubble one), the checker's simulated bubble (forward 1, backward 2), the most micro-batches
in flight per stage (counted by the executor) and the peak bytes of saved activations per stage
(`saved_tensors_hooks`). Same model as `pipeline_vs_torch.py`.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pipeline_vs_torch import SavedBytes, _free_port, layers, lm_loss

SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    os.environ.setdefault("MINISPEED_ACCELERATOR", "cpu")
    torch.set_num_threads(args.threads)
    import minispeed.comm as comm
    import minispeed.pipeline as pp

    comm.init_distributed(backend="gloo")
    out = {}
    for m in args.micro_batches:
        g = torch.Generator().manual_seed(0)
        tok = torch.randint(0, args.vocab, (m * args.mb_size, args.seq + 1), generator=g)
        x, y = tok[:, :-1], tok[:, 1:]
        for name in args.schedules:
            v = 2 if name == "interleaved_1f1b" else 1
            if (name != "gpipe" and m < args.stages) or (v > 1 and m % args.stages):
                continue
            module = pp.partition(layers(args), stages=world, loss_fn=lm_loss, method="type:Block",
                                  virtual_stages=v)  # fmt: skip
            ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.01),
                                     micro_batches=m, schedule=name)  # fmt: skip
            saved = SavedBytes(list(module.parameters()))
            times, busy = [], []
            for i in range(args.warmup + args.steps):
                comm.barrier()
                t0 = time.perf_counter()
                with saved.hooks():
                    ex.train_batch(x, y)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
                    busy.append(ex.timeline.busy_s())
            out[(name, m)] = {"times": times, "busy": busy, "in_flight": ex.peak_in_flight,
                              "saved": saved.peak}  # fmt: skip
    queue.put((rank, out))
    comm.barrier()
    comm.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, nargs="*", default=[2, 4, 8])
    ap.add_argument("--mb-size", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--schedules", nargs="*", default=list(SCHEDULES), choices=SCHEDULES)
    args = ap.parse_args(argv)

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.stages, port, args, queue))
        for r in range(args.stages)
    ]
    for proc in procs:
        proc.start()
    results = dict(queue.get() for _ in procs)
    for proc in procs:
        proc.join()

    from rich.console import Console
    from rich.table import Table

    import minispeed.pipeline as pp

    p = args.stages
    table = Table(title=f"minispeed schedules, P={p} (loaded 2-core CPU)")
    for col in ("schedule", "M", "step ms", "bubble measured", "formula", "simulated",
                "in flight per stage", "act MiB per stage"):  # fmt: skip
        table.add_column(col, justify="right")
    for key in results[0]:
        name, m = key
        runs = [results[r][key] for r in range(p)]
        steps = [max(r["times"][i] for r in runs) for i in range(args.steps)]
        bubble = statistics.median(
            1 - sum(r["busy"][i] for r in runs) / (p * steps[i]) for i in range(args.steps)
        )
        v = 2 if name == "interleaved_1f1b" else 1
        cls = pp.get_schedule(name)
        formula = (
            pp.costs.zero_bubble_fraction(p, m) if name == "zb_h1" else pp.bubble_fraction(p, m, v)
        )
        sim = pp.check(cls(m, p, v)).bubble_fraction()
        table.add_row(name, str(m), f"{statistics.median(steps) * 1e3:.0f}", f"{bubble:.1%}",
                      f"{formula:.1%}", f"{sim:.1%}", " / ".join(str(r["in_flight"]) for r in runs),
                      " / ".join(f"{r['saved'] / 2**20:.1f}" for r in runs))  # fmt: skip
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
