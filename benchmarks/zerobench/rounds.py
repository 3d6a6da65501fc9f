"""Step times of the contenders, taken in turns (rounds), and a CPU profile of one of them."""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zerobench.contenders import build

if TYPE_CHECKING:
    from data import CharDataset


def global_batches(args: argparse.Namespace, dataset: CharDataset, rank: int, world: int, n: int):
    """This rank's half (1/world) of each of the first `n` global batches of the corpus."""
    global_batch = args.micro_batch * world
    return [
        dataset.batch("train", i, global_batch, args.block_size, args.seed, rank, world)
        for i in range(n)
    ]


def time_contenders(args, names, dataset, rank, world) -> dict[str, dict[str, Any]]:
    """Step times (slower rank) of each contender, per round; contenders take turns each round."""
    n_total = args.warmup + args.rounds * args.steps_per_round
    batches = global_batches(args, dataset, rank, world, n_total)
    trainers = {n: build(n, args, dataset.tokenizer.vocab_size) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu_times: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    cursor = dict.fromkeys(names, 0)

    def run(name: str, k: int, record: bool) -> None:
        for _ in range(k):
            x, y = batches[cursor[name]]
            cursor[name] += 1
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            loss = trainers[name].step(x, y)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            df = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            losses[name].append(loss)
            if record:
                times[name].append(dt)
                cpu_times[name].append(dc)
                faults[name].append(df)

    for name in names:
        run(name, args.warmup, record=False)
    for _ in range(args.rounds):
        for name in names:
            run(name, args.steps_per_round, record=True)
    out = {}
    for name in names:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slower rank ends
        c = torch.tensor(cpu_times[name], dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
        f = torch.tensor(faults[name], dtype=torch.float64)
        dist.all_reduce(f, op=dist.ReduceOp.MAX)
        lo = torch.tensor(losses[name], dtype=torch.float64)
        dist.all_reduce(lo)
        k = args.steps_per_round
        per_round = [statistics.median(t[r * k : (r + 1) * k].tolist()) for r in range(args.rounds)]
        out[name] = {
            "median_step_s": statistics.median(t.tolist()),
            "round_median_step_s": per_round,
            "median_cpu_s": statistics.median(c.tolist()),
            # Minor page faults: memory the kernel handed over (zeroed) during the step; each
            # fresh allocation above glibc's mmap threshold costs one per 4 KiB page.
            "median_page_faults": statistics.median(f.tolist()),
            "mean_losses": (lo / world).tolist(),
        }
    return out


def profile_steps(args, name: str, dataset, rank: int, world: int) -> str:
    """Rank 0's top ops by self CPU time over `--profile-steps` steps of `name` (after 2 warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    batches = global_batches(args, dataset, rank, world, args.profile_steps + 2)
    trainer = build(name, args, dataset.tokenizer.vocab_size)
    for x, y in batches[:2]:
        trainer.step(x, y)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in batches[2:]:
            trainer.step(x, y)
    return prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48
    )
