"""What one stage-3 step's all-gathers cost beyond the limit's replay of them, term by term.

Issue 34 point 1: the `ZeRO-3 limit - floor` contender (`zerobench/limit.py`) replays the
step's all-gathers in place on one buffer allocated once. Stage 3 gathers each parameter into its
own full buffer, allocated when gathered, from a shard stored apart. This script takes the
limit's own list of one steady step's float32 all-gathers (logged from a real ZeRO-3 step and
checked against the ledger, as the contender does) and replays it, on 2 gloo ranks, five ways,
each adding one term, in turns (`--reps` rounds; main thread's CPU from `time.thread_time`, all
threads' from `time.process_time`, median per rank):

| variant | what it adds |
|---|---|
| `limit` | the contender's replay: in place, one buffer for every call |
| `distinct` | a buffer per call (the step's destinations are distinct), still in place, allocated once |
| `distinct+copy` | the own shard stored apart: copied into this rank's chunk before the broadcasts |
| `fresh+copy` | each buffer's storage allocated for the call and freed after the step (stage 3's `allocate_full` / `to_sharded`) |
| `comm` | the same through `comm.all_gather_into_tensor` (checks, record, loan: what stage 3's call of one parameter runs) |

```bash
.venv/bin/python benchmarks/stage3_gather_costs.py --size large --reps 5
.venv/bin/python benchmarks/stage3_gather_costs.py --size small --reps 20
```
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from zerobench.contenders import SIZES, build, size_args  # noqa: E402
from zerobench.limit import replay  # noqa: E402
from zerobench.ranks import run_ranks  # noqa: E402


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), MINISPEED_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    from data import CharDataset

    import minispeed.comm as comm

    comm.init_distributed(backend="gloo")
    vocab = CharDataset.from_file().tokenizer.vocab_size
    calls = build("ZeRO-3 limit - floor", args, vocab).keep[0]
    gathers = [c for c in calls if c.op == "all_gather" and c.dtype == torch.float32]
    ranks = list(range(world))
    distinct = [torch.zeros(c.numel) for c in gathers]
    shards = [torch.randn(c.numel // world) for c in gathers]
    fulls = [torch.empty(c.numel) for c in gathers]

    def free() -> None:
        for f in fulls:
            f.untyped_storage().resize_(0)

    def broadcasts(whole: torch.Tensor) -> None:
        chunks = whole.view(world, -1)
        works = [dist.broadcast(c, j, async_op=True) for c, j in zip(chunks, ranks)]
        for w in works:
            w.wait()

    def own(whole: torch.Tensor, shard: torch.Tensor) -> None:
        whole.view(world, -1)[rank].copy_(shard)

    def v_distinct(copy: bool = False) -> None:
        for b, s in zip(distinct, shards):
            if copy:
                own(b, s)
            broadcasts(b)

    def v_fresh() -> None:
        for f, s in zip(fulls, shards):
            f.untyped_storage().resize_(f.numel() * 4)
            own(f, s)
            broadcasts(f)
        free()

    def v_comm() -> None:
        for f, s in zip(fulls, shards):
            f.untyped_storage().resize_(f.numel() * 4)
            comm.all_gather_into_tensor(f, s, async_op=True).wait()
        free()

    free()
    variants = {
        "limit": replay(gathers),
        "distinct": v_distinct,
        "distinct+copy": lambda: v_distinct(copy=True),
        "fresh+copy": v_fresh,
        "comm": v_comm,
    }
    cpu = {k: ([], []) for k in variants}
    for f in variants.values():  # warm-up
        f()
    for _ in range(args.reps):
        for name, f in variants.items():
            dist.barrier()
            c0, m0 = time.process_time(), time.thread_time()
            f()
            cpu[name][0].append((time.thread_time() - m0) * 1e3)
            cpu[name][1].append((time.process_time() - c0) * 1e3)
    numel = sum(c.numel for c in gathers)
    queue.put((rank, (len(gathers), numel, cpu)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="large")
    p.add_argument("--keys", default="deepspeed")
    p.add_argument("--reps", type=int, default=5)
    args = size_args(p.parse_args())
    print(f"load {os.getloadavg()[0]:.1f}")
    results = run_ranks(_worker, 2, args)
    for rank in (0, 1):
        count, numel, cpu = results[rank]
        print(f"rank {rank}: {count} float32 all-gathers, {numel / 1e6:.2f}M elements a step")
        print(f"  {'variant':14} {'main ms':>8} {'all ms':>8}   main ms per round")
        for name, (main_ms, all_ms) in cpu.items():
            m, a = statistics.median(main_ms), statistics.median(all_ms)
            print(f"  {name:14} {m:8.1f} {a:8.1f}   {[round(x, 1) for x in main_ms]}")


if __name__ == "__main__":
    main()
