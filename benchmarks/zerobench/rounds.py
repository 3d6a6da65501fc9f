"""Step times of the contenders, taken in turns (rounds), and a CPU profile or the Python calls
of one of them."""

from __future__ import annotations

import argparse
import os
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
    # Per step, (wall, CPU) seconds of each phase: forward, backward, optimizer step.
    phases: dict[str, list[list[float]]] = {n: [] for n in names}
    cursor = dict.fromkeys(names, 0)

    def run(name: str, k: int, record: bool) -> None:
        trainer = trainers[name]
        for _ in range(k):
            x, y = batches[cursor[name]]
            cursor[name] += 1
            dist.barrier()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.process_time()
            loss = trainer.forward(x, y)
            t1, c1 = time.perf_counter(), time.process_time()
            trainer.backward(loss)
            t2, c2 = time.perf_counter(), time.process_time()
            trainer.optimizer_step()
            t3, c3 = time.perf_counter(), time.process_time()
            df = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            losses[name].append(loss.item())
            if record:
                times[name].append(t3 - t0)
                cpu_times[name].append(c3 - c0)
                faults[name].append(df)
                phases[name].append([t1 - t0, t2 - t1, t3 - t2, c1 - c0, c2 - c1, c3 - c2])

    for name in names:
        run(name, args.warmup, record=False)
    loads = []  # the 1-minute load average at the start of each round
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in names:
            run(name, args.steps_per_round, record=True)
    out: dict[str, Any] = {"load_per_round": loads}
    for name in names:
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slower rank ends
        c = torch.tensor(cpu_times[name], dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
        f = torch.tensor(faults[name], dtype=torch.float64)
        dist.all_reduce(f, op=dist.ReduceOp.MAX)
        ph = torch.tensor(phases[name], dtype=torch.float64)
        dist.all_reduce(ph, op=dist.ReduceOp.MAX)  # each phase: its slower rank
        lo = torch.tensor(losses[name], dtype=torch.float64)
        dist.all_reduce(lo)
        k = args.steps_per_round
        per_round = [statistics.median(t[r * k : (r + 1) * k].tolist()) for r in range(args.rounds)]
        cpu_round = [statistics.median(c[r * k : (r + 1) * k].tolist()) for r in range(args.rounds)]
        out[name] = {
            "median_step_s": statistics.median(t.tolist()),
            "round_median_step_s": per_round,
            "median_cpu_s": statistics.median(c.tolist()),
            "round_median_cpu_s": cpu_round,
            # Minor page faults: memory the kernel handed over (zeroed) during the step; each
            # fresh allocation above glibc's mmap threshold costs one per 4 KiB page.
            "median_page_faults": statistics.median(f.tolist()),
            # forward, backward, optimizer step: wall then CPU seconds, median over timed steps
            "median_phase_s": [statistics.median(col) for col in ph.T.tolist()],
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


def count_steps(args, name: str, dataset, rank: int, world: int) -> str:
    """Rank 0's Python calls per step of `name` over `--profile-steps` steps (after 2 warm-up):
    by group, then the 30 functions called most. Counted by `sys.setprofile`
    (`engine_vs_deepspeed.count_calls`), so the same on every run, whatever the load."""
    from engine_vs_deepspeed import _by_group, count_calls

    batches = global_batches(args, dataset, rank, world, args.profile_steps + 2)
    trainer = build(name, args, dataset.tokenizer.vocab_size)
    for x, y in batches[:2]:
        trainer.step(x, y)
    dist.barrier()
    counts = count_calls(lambda: [trainer.step(x, y) for x, y in batches[2:]])
    python = {k: c for k, c in counts.items() if not k[1].startswith("[builtin]")}
    per = args.profile_steps
    lines = [f"{sum(python.values()) / per:.0f} Python calls per step"]
    lines += [f"  {g:<22} {c / per:9.1f}" for g, c in _by_group(python).most_common()]
    top = sorted(python.items(), key=lambda kv: -kv[1])[:30]
    lines += [f"    {c / per:9.1f}  {g:<20} {f}" for (g, f), c in top]
    return "\n".join(lines)
