"""minispeed's ZeRO stages against their PyTorch counterparts: same run, 2 gloo processes.

Pairs (each of ours against the torch mechanism it re-implements):

| ours | torch baseline | DeepSpeed (optional) |
|---|---|---|
| ZeRO-0 | DistributedDataParallel (bucketed gradient all-reduce) | ZeRO stage 0 |
| ZeRO-1 | ZeroRedundancyOptimizer over DDP (optimizer state sharded) | ZeRO stage 1 |
| ZeRO-2 | ZeroRedundancyOptimizer over DDP (torch has no stage-2 equivalent) | ZeRO stage 2 |
| ZeRO-3 | FSDP2 `fully_shard` on every transformer block and on the root | ZeRO stage 3 |

DeepSpeed joins when it is installed (`DS_BUILD_OPS=0 pip install --no-build-isolation
deepspeed`; it runs with `DS_ACCELERATOR=cpu` on the same gloo group) or when `--deepspeed` asks
for it. minispeed and DeepSpeed are configured by the same `zero_optimization` dict
(`--keys`): ours through `ZeroConfig.from_ds_config`, DeepSpeed through `deepspeed.initialize`.
The torch baselines keep their own defaults (DDP's 25 MiB buckets, FSDP2 per block).

Sizes (`--size`): `small` (3.2M parameters, context 64, micro-batch 8: per-call overheads
decide) and `large` (33.9M, 8 layers of width 592, context 256, micro-batch 4: compute and
bandwidth decide).

The run: `examples/gpt.py`'s GPT (fp32, AdamW lr 1e-3, no clipping), every contender built
from the same seed and fed the same batches of the bundled corpus (each rank its half of the
global batch). One process group serves all contenders; each keeps its own model.

**Step time**: forward, backward, optimizer step, zero_grad. Contenders take turns in rounds
(`--rounds` rounds of `--steps-per-round` steps each, after `--warmup` steps), so that
load from other programs on the machine falls on all of them alike. Each step starts after a
barrier; its time is the slower rank's. Per contender we report the median over all timed
steps; per pair, the median over rounds of (our median / torch's median in that round), with
its range: a paired comparison, each ratio taken under the same load. We also report the
process CPU time per step (all threads, gloo's included; slower rank): it is far less sensitive
to other programs on the machine than wall time, but it does not see time spent waiting.

**Peak memory per rank** (one method for every contender): the bytes malloc has handed out in
the process (glibc `mallinfo2`: arena chunks in use + mmapped blocks; torch's CPU allocator
is malloc), sampled after every tensor op by a `TorchDispatchMode` (forward and backward ops
and the collectives all pass the dispatcher). We read it before a fresh copy of the contender is
built (the baseline), after it is built, and after every op of `--memory-steps` training steps;
peak = the largest sample minus the baseline. It counts everything the contender holds
(parameters, gathered parameters, gradients, optimizer state, flat buffers, communication
buffers, gloo's own) and everything a step allocates (activations, temporaries), whichever
thread frees it. The process has run every contender before (the timing phase), so library
workspaces (oneDNN, gloo) exist before any baseline. Not seen: a buffer allocated and freed
inside one op (it never outlives a sample).

Why not `torch.profiler(profile_memory=True)`: its allocation events are recorded per thread,
and frees that happen on gloo's threads are missed, so live bytes drift upward by whole
buffers at random (we saw +6 to +18 MiB on some ranks), unequally between contenders.

Run:

``bash
python benchmarks/zero_vs_torch.py                 # the numbers in docs/benchmarks.md
python benchmarks/zero_vs_torch.py --json out.json # plus machine-readable results
python benchmarks/zero_vs_torch.py --profile ZeRO-3 --profile "torch FSDP2"  # where time goes
python benchmarks/zero_vs_torch.py --size large --keys deepspeed --rounds 6  # 33.9M, DS defaults
``

Benchmarks may use `torch.distributed` directly for the torch baselines; minispeed's contenders
go through `minispeed.comm` like any user.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from data import CharDataset  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

# (ours, its torch counterpart); the order is also the order of the table.
PAIRS = [
    ("ZeRO-0", "torch DDP"),
    ("ZeRO-1", "torch ZeroRedundancyOptimizer"),
    ("ZeRO-2", "torch ZeroRedundancyOptimizer"),
    ("ZeRO-3", "torch FSDP2"),
]
# Against DDP as well at every stage <= 2: the goal "no slower than DDP" at both key sets.
PAIRS_DDP = [("ZeRO-1", "torch DDP"), ("ZeRO-2", "torch DDP")]
PAIRS_DEEPSPEED = [(f"ZeRO-{k}", f"DeepSpeed ZeRO-{k}") for k in range(4)]
CONTENDERS = [
    "torch DDP",
    "ZeRO-0",
    "torch ZeroRedundancyOptimizer",
    "ZeRO-1",
    "ZeRO-2",
    "torch FSDP2",
    "ZeRO-3",
    "floor (no communication)",
]
#: What any data-parallel ZeRO step must at least compute: see `build`. It does not train (its
#: parameters never change), so it is left out of the loss comparison.
FLOOR = "floor (no communication)"
#: Most a contender's mean loss may differ from the first's at any step (fp32; reduction orders
#: differ between systems) before the benchmark refuses to compare their times.
LOSS_TOLERANCE = 1e-3
DEEPSPEED_CONTENDERS = [f"DeepSpeed ZeRO-{k}" for k in range(4)]

# --size presets: (n_layer, n_head, n_embd, block_size, micro_batch)
SIZES = {"small": (4, 4, 256, 64, 8), "large": (8, 8, 592, 256, 4)}


def deepspeed_available() -> bool:
    """Whether `import deepspeed` works here (with its CPU accelerator)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


PHASES = ("forward", "backward", "optimizer")


@dataclass
class Trainer:
    """One contender, as its three phases; `step` runs them and returns the local loss."""

    name: str
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x, y) -> loss
    backward: Callable[[torch.Tensor], None]
    optimizer_step: Callable[[], None]  # the step and clearing the gradients
    keep: Any  # model and optimizer, kept alive while the trainer is

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One training step."""
        loss = self.forward(x, y)
        self.backward(loss)
        self.optimizer_step()
        return loss.item()


def _model(args: argparse.Namespace, vocab: int) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(
        GPTConfig(
            vocab_size=vocab,
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
        )
    )


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


#: torch DDP's default bucket (`bucket_cap_mb=25`) in fp32 elements: what stages 0 and 1 are
#: compared against (ZeroRedundancyOptimizer reduces gradients through DDP's buckets too).
DDP_BUCKET_NUMEL = 25 * 2**20 // 4


def _bucket_numel(args: argparse.Namespace, stage: int) -> int:
    """`--reduce-bucket-numel`, or by default the granularity of the stage's torch counterpart:
    DDP's 25 MiB buckets for stages 0-1; 500,000 elements for stages 2-3, whose staging buckets
    are transient memory (FSDP2 reduces one ~790,000-element block at a time here)."""
    if args.reduce_bucket_numel:
        return args.reduce_bucket_numel
    return DDP_BUCKET_NUMEL if stage <= 1 else 500_000


def zero_section(args: argparse.Namespace, stage: int, block_numel: int) -> dict[str, Any]:
    """The DeepSpeed `zero_optimization` dict that minispeed and DeepSpeed are both given.

    `--keys tuned`: the granularity of each stage's torch counterpart (see `_bucket_numel`),
    stage 3 prefetching one transformer block as FSDP2 does; `deepspeed`: only the stage, so every
    size is DeepSpeed's default (5e8-element buckets, 5e7 prefetch, 1e5 persistence threshold);
    `ddp`: DDP's 25 MiB buckets for reduce and all-gather.
    """
    section: dict[str, Any] = {"stage": stage}
    if args.keys == "tuned":
        section["reduce_bucket_size"] = _bucket_numel(args, stage)
        section["stage3_param_persistence_threshold"] = args.persistence_threshold
        section["stage3_prefetch_bucket_size"] = args.prefetch_numel or block_numel
    elif args.keys == "ddp":
        section["reduce_bucket_size"] = DDP_BUCKET_NUMEL
        section["allgather_bucket_size"] = DDP_BUCKET_NUMEL
    elif args.reduce_bucket_numel:
        section["reduce_bucket_size"] = args.reduce_bucket_numel
    if args.overlap_comm != "default":  # otherwise each system's own default for the stage
        section["overlap_comm"] = args.overlap_comm == "true"
    return section


def build(name: str, args: argparse.Namespace, vocab: int) -> Trainer:
    """A fresh contender `name` over a model built from `args.seed`."""
    model = _model(args, vocab)
    if name == "torch DDP" or name == "torch ZeroRedundancyOptimizer":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if name == "torch DDP":
            opt = _adamw(ddp.parameters())
        else:
            opt = ZeroRedundancyOptimizer(
                ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.01
            )

        def ddp_step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Trainer(name, lambda x, y: ddp(x, y)[1], torch.Tensor.backward, ddp_step, (ddp, opt))
    if name == "torch FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = _adamw(model.parameters())

        def fsdp_step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Trainer(
            name, lambda x, y: model(x, y)[1], torch.Tensor.backward, fsdp_step, (model, opt)
        )
    if name == FLOOR:
        # The compute every rank of a ZeRO step must do, with no communication and no
        # bookkeeping: forward and backward on this rank's micro-batch, then AdamW over this
        # rank's 1/N of every parameter (one tensor per parameter, as ZeRO's masters are: one
        # flat tensor would make torch's AdamW allocate model-sized temporaries, which cost
        # fresh pages every step; gradients are zero buffers, as the arithmetic does not depend
        # on the values). No data-parallel system that keeps the same model, batch and
        # optimizer can beat it on this machine, so it bounds every ratio.
        world = dist.get_world_size()
        shards = [
            torch.zeros(-(-p.numel() // world), requires_grad=True) for p in model.parameters()
        ]
        for shard in shards:
            shard.grad = torch.zeros_like(shard)
        floor_opt = _adamw(shards)

        def floor_step() -> None:
            floor_opt.step()
            model.zero_grad(set_to_none=True)

        return Trainer(
            name, lambda x, y: model(x, y)[1], torch.Tensor.backward, floor_step, (model, shards)
        )
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    if name.startswith("ZeRO-"):
        import minispeed.zero as zero

        stage = int(name.removeprefix("ZeRO-"))
        section = zero_section(args, stage, block_numel)
        cfg = zero.ZeroConfig.from_ds_config({"zero_optimization": section})
        zopt = zero.shard(model, _adamw(model.parameters()), config=cfg)

        # zopt.step() also clears the gradients, as zero_grad(set_to_none=True) does for torch.
        return Trainer(name, lambda x, y: model(x, y)[1], zopt.backward, zopt.step, (model, zopt))
    if name.startswith("DeepSpeed ZeRO-"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        stage = int(name.removeprefix("DeepSpeed ZeRO-"))
        ds_config = {
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": 1,
            # DeepSpeed 0.19.8 clips at 1.0 when the key is left out (GRADIENT_CLIPPING_DEFAULT);
            # DDP, FSDP2 and our stages do not clip here, so DeepSpeed must not either, or it
            # trains something else (it ended 1.48 in loss away at 33.9M parameters).
            "gradient_clipping": 0.0,
            "zero_optimization": zero_section(args, stage, block_numel),
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=_adamw(model.parameters()), config=ds_config
        )
        # engine.step() steps and clears the gradients.
        return Trainer(
            name, lambda x, y: engine(x, y)[1], engine.backward, engine.step, (engine, model)
        )
    raise ValueError(f"unknown contender {name!r}; choose from {CONTENDERS}")


def _batches(args: argparse.Namespace, dataset: CharDataset, rank: int, world: int, n: int):
    global_batch = args.micro_batch * world
    return [
        dataset.batch("train", i, global_batch, args.block_size, args.seed, rank, world)
        for i in range(n)
    ]


def time_contenders(args, names, dataset, rank, world) -> dict[str, dict[str, Any]]:
    """Step times (slower rank) of each contender, per round; contenders take turns each round."""
    n_total = args.warmup + args.rounds * args.steps_per_round
    batches = _batches(args, dataset, rank, world, n_total)
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


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _heap_reader() -> Callable[[], int]:
    """A function returning the bytes malloc has handed out in this process, all threads."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        raise SystemExit(
            "the memory measurement needs glibc >= 2.33 (mallinfo2); run the benchmark on Linux"
        ) from None

    def in_use() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd  # arena chunks in use + mmapped blocks

    return in_use


class HeapPeak(TorchDispatchMode):
    """Samples the process's heap after every tensor op; keeps the largest value per phase.

    Every torch op, forward or backward, including the collectives, passes through the dispatcher,
    so a sample follows each allocation an op returns. malloc's counters are process-wide, so
    buffers freed by gloo's threads are seen as freed (torch.profiler's memory events are
    per-thread and miss those frees).
    """

    def __init__(self, in_use: Callable[[], int]) -> None:
        super().__init__()
        self.in_use = in_use
        self.phase = "forward"
        self.peaks: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        now = self.in_use()
        if now > self.peaks.get(self.phase, 0):
            self.peaks[self.phase] = now
        return out


def peak_memory(args, name: str, dataset, rank: int, world: int) -> dict[str, int]:
    """Peak bytes a fresh `name` adds to this process's heap over `--memory-steps` steps."""
    in_use = _heap_reader()
    batches = _batches(args, dataset, rank, world, args.memory_steps)
    gc.collect()
    dist.barrier()
    base = in_use()  # everything before the contender exists
    trainer = build(name, args, dataset.tokenizer.vocab_size)
    gc.collect()
    built = in_use() - base
    peak = built
    with HeapPeak(in_use) as sampler:
        for x, y in batches:
            sampler.peaks.clear()  # after the loop: the last step's peaks, phase by phase
            sampler.phase = "forward"
            loss = trainer.forward(x, y)
            sampler.phase = "backward"
            trainer.backward(loss)
            sampler.phase = "optimizer"
            trainer.optimizer_step()
            peak = max(peak, *(v - base for v in sampler.peaks.values()))
    out = {"peak_bytes": peak, "before_first_step_bytes": built}
    for phase in PHASES:
        out[f"last_step_{phase}_peak_bytes"] = sampler.peaks.get(phase, base) - base
    del trainer, loss
    gc.collect()
    out["end_bytes"] = in_use() - base  # what the contender failed to give back (should be ~0)
    return out


def profile_steps(args, name: str, dataset, rank: int, world: int) -> str:
    """Rank 0's top ops by self CPU time over `--profile-steps` steps of `name` (after 2 warm-up)."""
    from torch.profiler import ProfilerActivity, profile

    batches = _batches(args, dataset, rank, world, args.profile_steps + 2)
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


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("MINISPEED_ACCELERATOR", "cpu")
    torch.set_num_threads(args.threads)
    import minispeed.comm as comm

    comm.init_distributed(backend="gloo")
    dataset = CharDataset.from_file()
    names = args.contenders
    result: dict[str, Any] = {
        "timing": time_contenders(args, names, dataset, rank, world),
        "memory": {},
    }
    for name in names:
        result["memory"][name] = peak_memory(args, name, dataset, rank, world)
    result["profiles"] = {n: profile_steps(args, n, dataset, rank, world) for n in args.profile}
    queue.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _goal(ours: str, theirs: str, time_ratio: float, mem_ratio: float) -> tuple[str, bool]:
    """The goal of one pair (issues 4 and 14) and whether this run met it."""
    if theirs.startswith("DeepSpeed") and ours == "ZeRO-3":
        return "time <= 0.85x", time_ratio <= 0.85
    if theirs.startswith("DeepSpeed"):
        return "time <= 1x", time_ratio <= 1.0
    if ours == "ZeRO-3":
        return "time <= 1x, memory <= 1x", time_ratio <= 1.0 and mem_ratio <= 1.0
    return "time <= 1x", time_ratio <= 1.0


def report(results: dict[int, dict], args: argparse.Namespace) -> dict[str, Any]:
    """Print the tables (rich) and return the summary written by `--json`."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(120, Console().width))
    names = args.contenders
    timing = results[0]["timing"]
    ref_losses = timing[next(n for n in names if n != FLOOR)]["mean_losses"]
    summary: dict[str, Any] = {"args": vars(args), "contenders": {}}
    table = Table(title=f"step time and peak memory per rank ({args.world_size} gloo processes)")
    for col in (
        "contender",
        "median step",
        "CPU s/step",
        "page faults/step",
        "peak mem rank 0",
        "peak mem rank 1",
        "max |Δloss| vs first",
    ):
        table.add_column(col, justify="left" if col == "contender" else "right")
    for name in names:
        peaks = [results[r]["memory"][name]["peak_bytes"] for r in sorted(results)]
        dloss = max(abs(a - b) for a, b in zip(timing[name]["mean_losses"], ref_losses))
        if name == FLOOR:  # does not train
            dloss = float("nan")
        summary["contenders"][name] = {
            "median_step_s": timing[name]["median_step_s"],
            "median_cpu_s": timing[name]["median_cpu_s"],
            "median_page_faults": timing[name]["median_page_faults"],
            "peak_bytes_per_rank": peaks,
            "memory": {r: results[r]["memory"][name] for r in sorted(results)},
            "max_abs_loss_diff": dloss,
        }
        table.add_row(
            name,
            f"{timing[name]['median_step_s'] * 1e3:.1f} ms",
            f"{timing[name]['median_cpu_s'] * 1e3:.1f} ms",
            f"{timing[name]['median_page_faults']:.0f}",
            *(f"{p / 2**20:.2f} MiB" for p in peaks[:2]),
            f"{dloss:.2e}",
        )
    console.print(table)
    # A ratio between runs that train different things means nothing: refuse to print one.
    differ = {
        n: d["max_abs_loss_diff"]
        for n, d in summary["contenders"].items()
        if n != FLOOR and not d["max_abs_loss_diff"] <= LOSS_TOLERANCE
    }
    if differ:
        raise SystemExit(
            f"contenders {sorted(differ)} end {max(differ.values()):.2e} in loss away from "
            f"{names[0]!r} (tolerance {LOSS_TOLERANCE}): they do not train the same thing, so no "
            f"ratio is reported; make their configurations agree"
        )
    phases = Table(
        title="where the peak is: largest live bytes in each phase of the last measured step (rank 0)"
    )
    for col in ("contender", "before step", *PHASES):
        phases.add_column(col, justify="left" if col == "contender" else "right")
    for name in names:
        m = results[0]["memory"][name]
        phases.add_row(
            name,
            f"{m['before_first_step_bytes'] / 2**20:.2f} MiB",
            *(f"{m[f'last_step_{ph}_peak_bytes'] / 2**20:.2f} MiB" for ph in PHASES),
        )
    console.print(phases)
    pairs = Table(title="ours / torch (same run; < 1 is better for us)")
    for col in (
        "ours",
        "torch",
        "step time ratio",
        "range over rounds",
        "CPU time ratio",
        "peak memory ratio",
        "goal",
    ):
        pairs.add_column(col, justify="left" if col in ("ours", "torch", "goal") else "right")
    summary["pairs"] = []
    for ours, theirs in PAIRS + PAIRS_DDP + PAIRS_DEEPSPEED:
        if ours not in names or theirs not in names:
            continue
        # Paired by round: both ran within seconds of each other, under the same machine load.
        ratios = [
            a / b
            for a, b in zip(
                timing[ours]["round_median_step_s"], timing[theirs]["round_median_step_s"]
            )
        ]
        t = statistics.median(ratios)
        lo_t, hi_t = min(ratios), max(ratios)
        m = max(summary["contenders"][ours]["peak_bytes_per_rank"]) / max(
            summary["contenders"][theirs]["peak_bytes_per_rank"]
        )
        goal, met = _goal(ours, theirs, t, m)
        verdict = ("[green]met[/] " if met else "[red]missed[/] ") + goal
        cpu = (
            summary["contenders"][ours]["median_cpu_s"]
            / summary["contenders"][theirs]["median_cpu_s"]
        )
        pairs.add_row(
            ours, theirs, f"{t:.3f}", f"{lo_t:.2f}-{hi_t:.2f}", f"{cpu:.3f}", f"{m:.3f}", verdict
        )
        summary["pairs"].append(
            {
                "ours": ours,
                "torch": theirs,
                "time_ratio": t,
                "time_ratio_range": [lo_t, hi_t],
                "cpu_time_ratio": cpu,
                "memory_ratio": m,
                "met": met,
            }
        )
    console.print(pairs)
    if FLOOR in names:
        summary["over_floor"] = _over_floor(console, timing, names)
    for name, text in results[0].get("profiles", {}).items():
        console.print(f"\n[bold]profile of {name}[/] (rank 0, {args.profile_steps} steps)")
        console.print(text, markup=False, highlight=False)
        summary.setdefault("profiles", {})[name] = text
    return summary


def _over_floor(console: Any, timing: dict[str, dict[str, Any]], names: list[str]) -> dict:
    """Each contender's step over the compute floor's, paired by round, and what that says of
    the goal "ZeRO-3 at most 0.85x DeepSpeed's ZeRO-3": reachable only where 0.85x DeepSpeed's
    step is above the floor."""
    from rich.table import Table

    table = Table(title="step / compute floor (same run, paired by round; 1.00 = pure compute)")
    for col in ("contender", "step / floor", "range over rounds", "time above the floor"):
        table.add_column(col, justify="left" if col == "contender" else "right")
    floor = timing[FLOOR]["round_median_step_s"]
    out: dict[str, Any] = {}
    for name in names:
        if name == FLOOR:
            continue
        ratios = [a / b for a, b in zip(timing[name]["round_median_step_s"], floor)]
        r = statistics.median(ratios)
        above = timing[name]["median_step_s"] - timing[FLOOR]["median_step_s"]
        out[name] = {"ratio": r, "range": [min(ratios), max(ratios)], "above_s": above}
        table.add_row(name, f"{r:.3f}", f"{min(ratios):.2f}-{max(ratios):.2f}", f"{above:.3f} s")
    console.print(table)
    ds3 = out.get("DeepSpeed ZeRO-3")
    if ds3 is not None:
        bound = 1.0 / ds3["ratio"]  # floor / DeepSpeed ZeRO-3: the best ratio any system can reach
        out["best_possible_vs_deepspeed_zero3"] = bound
        console.print(
            f"floor / DeepSpeed ZeRO-3 = {bound:.3f}: no data-parallel step on this machine can be "
            f"faster than {bound:.3f}x DeepSpeed's ZeRO-3 here, so a goal of 0.85x is "
            + ("within reach" if bound <= 0.85 else "[red]below the compute floor[/]")
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse options, run the 2-process benchmark, print and optionally save the results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--size", choices=sorted(SIZES), default="small", help="model preset")
    p.add_argument("--n-layer", type=int, default=None, help="overrides --size")
    p.add_argument("--n-head", type=int, default=None, help="overrides --size")
    p.add_argument("--n-embd", type=int, default=None, help="overrides --size")
    p.add_argument("--block-size", type=int, default=None, help="overrides --size")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per step")
    p.add_argument(
        "--keys",
        choices=("tuned", "deepspeed", "ddp"),
        default="tuned",
        help="zero_optimization given to minispeed and DeepSpeed (see zero_section)",
    )
    p.add_argument(
        "--deepspeed",
        choices=("auto", "yes", "no"),
        default="auto",
        help="add DeepSpeed's stages as contenders (auto: when it imports)",
    )
    p.add_argument(
        "--overlap-comm",
        choices=("default", "true", "false"),
        default="default",
        help="overlap_comm in the zero_optimization dict (default: leave it out)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps-per-round", type=int, default=1)
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument(
        "--persistence-threshold", type=int, default=0, help="ZeRO-3: params <= this stay whole"
    )
    p.add_argument(
        "--reduce-bucket-numel",
        type=int,
        default=0,
        help="ZeRO gradient bucket, elements (0: DDP's 25 MiB for stages 0-1, 500,000 for 2-3)",
    )
    p.add_argument(
        "--prefetch-numel", type=int, default=0, help="ZeRO-3 prefetch elements (0: one block)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--contenders", nargs="*", default=None, help=f"subset of {CONTENDERS}")
    p.add_argument(
        "--profile", action="append", default=[], help="print a CPU profile of this contender"
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    preset = dict(
        zip(("n_layer", "n_head", "n_embd", "block_size", "micro_batch"), SIZES[args.size])
    )
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    known = list(CONTENDERS)
    if args.deepspeed == "yes" or (args.deepspeed == "auto" and deepspeed_available()):
        if not deepspeed_available():
            p.error(
                "--deepspeed yes: `import deepspeed` fails; DS_BUILD_OPS=0 pip install deepspeed"
            )
        known += DEEPSPEED_CONTENDERS
    for n in (args.contenders or []) + args.profile:
        if n not in known:
            p.error(f"unknown contender {n!r}; choose from {known}")
    if not args.contenders:
        args.contenders = known
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world_size, port, args, queue))
        for r in range(args.world_size)
    ]
    for pr in procs:
        pr.start()
    results: dict[int, dict] = {}
    while len(results) < len(procs):
        try:
            rank, res = queue.get(timeout=5)
            results[rank] = res
        except Exception:  # queue.Empty: check that nobody died
            dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
            if dead:
                for pr in procs:
                    pr.kill()
                raise SystemExit(
                    f"benchmark rank(s) {dead} failed; see their tracebacks above"
                ) from None
    for pr in procs:
        pr.join()
        if pr.exitcode != 0:
            raise SystemExit(f"a benchmark process exited with code {pr.exitcode}")
    summary = report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
