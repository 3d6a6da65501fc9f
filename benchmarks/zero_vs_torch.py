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
(`--keys`): ours through `ZeroConfig.from_section`, DeepSpeed through `deepspeed.initialize`.
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

**The limit of each stage** (issue 34): the floor (forward, backward, AdamW over this rank's
1/N of each parameter, no communication) plus `ZeRO-k limit - floor`: the stage's own
collectives, logged from a real step and checked against `zero.ledger` (stages 0-2, call for
call) or `stage3_step_bytes` (stage 3, bytes per kind), replayed straight to torch.distributed
back to back, plus for stage 0 AdamW over the rest of each parameter (it steps all of it on every
rank). On 2 cores the collectives' reductions run on the cores compute needs, so floor + them,
summed round by round, is the least a stage can take; the report's step / limit table and the
phase table (forward, backward, optimizer step; wall and CPU) say how far each stage is and where.

Run:

``bash
python benchmarks/zero_vs_torch.py                 # the numbers in docs/benchmarks.md
python benchmarks/zero_vs_torch.py --json out.json # plus machine-readable results
python benchmarks/zero_vs_torch.py --profile ZeRO-3 --profile "torch FSDP2"  # where time goes
python benchmarks/zero_vs_torch.py --size large --keys deepspeed --contenders ZeRO-3 --rounds 1 \
    --calls ZeRO-3 --calls "floor (no communication)"  # Python calls per step, by where they go
python benchmarks/zero_vs_torch.py --size large --keys deepspeed --rounds 6  # 33.9M, DS defaults
python benchmarks/zero_vs_torch.py --world-size 4 --mics-shard-size 2 \
    --contenders "torch FSDP2 HSDP" MiCS "torch FSDP2" ZeRO-3     # MiCS vs HSDP, 2 x 2
``

`--checkpoint`: activation checkpointing on every contender alike, the floor included: each
transformer block's forward runs under `torch.utils.checkpoint` (non-reentrant, early stopping
off: the whole block is recomputed), set on the block
before FSDP2, DDP or ZeRO wraps the model. Activations then are the blocks' inputs plus one block's
at a time, so parameters, gradients and optimizer state weigh more in the peak; every step runs
each block's forward twice.

`--mics-shard-size S` adds MiCS (`ZeroConfig(stage=3, mics_shard_size=S)`) and FSDP2's HSDP
(`fully_shard` per block and on the root over a `(world/S) x S` replicate × shard
`DeviceMesh`), paired with each other: the same layout, parameters gathered inside groups of
S, gradients reduce-scattered inside them and all-reduced across.

Benchmarks may use `torch.distributed` directly for the torch baselines; minispeed's contenders
go through `minispeed.comm` like any user.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from data import CharDataset  # noqa: E402
from zerobench.contenders import (  # noqa: E402
    CONTENDERS,
    DEEPSPEED_CONTENDERS,
    MICS_CONTENDERS,
    SIZES,
    deepspeed_available,
)
from zerobench.heap import peak_memory  # noqa: E402
from zerobench.limit import LIMITS  # noqa: E402
from zerobench.ranks import run_ranks  # noqa: E402
from zerobench.report import report  # noqa: E402
from zerobench.rounds import count_steps, profile_steps, time_contenders  # noqa: E402


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
    from minispeed.comm.api_compat import reduce_scatter_as

    comm.init_distributed(backend="gloo")
    dataset = CharDataset.from_file()
    names = args.contenders
    with reduce_scatter_as(args.reduce_scatter):
        result: dict[str, Any] = {
            "timing": time_contenders(args, names, dataset, rank, world),
            "memory": {},
        }
        for name in names:
            if name not in LIMITS:  # no model of their own: their buffers are a few messages
                result["memory"][name] = peak_memory(args, name, dataset, rank, world)
        result["profiles"] = {n: profile_steps(args, n, dataset, rank, world) for n in args.profile}
        result["calls"] = {n: count_steps(args, n, dataset, rank, world) for n in args.calls}
    queue.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


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
        help="zero_optimization given to minispeed and DeepSpeed (see zerobench/contenders.py: zero_section)",
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
    p.add_argument(
        "--mics-shard-size",
        type=int,
        default=0,
        help="MiCS against FSDP2 HSDP on a (world/S) x S mesh (needs --world-size a multiple of S)",
    )
    p.add_argument(
        "--reduce-scatter",
        choices=("ring_p2p", "all_reduce"),
        default="ring_p2p",
        help="how minispeed runs gloo's reduce-scatters: comm's ring over p2p (the default), or "
        "as the all-reduce it ran before (minispeed.comm.api_compat.reduce_scatter_as)",
    )
    p.add_argument(
        "--checkpoint",
        action="store_true",
        help="every contender (the floor too) runs each transformer block under "
        "torch.utils.checkpoint, non-reentrant: one block's activations at a time, its forward twice",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--contenders", nargs="*", default=None, help=f"subset of {CONTENDERS}")
    p.add_argument(
        "--profile", action="append", default=[], help="print a CPU profile of this contender"
    )
    p.add_argument(
        "--calls",
        action="append",
        default=[],
        help="count this contender's Python calls per step (rank 0, --profile-steps steps)",
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
    if args.mics_shard_size:
        if args.mics_shard_size < 1 or args.world_size % args.mics_shard_size:
            p.error(f"--mics-shard-size must divide --world-size {args.world_size}")
        known += [n for n in MICS_CONTENDERS if n not in known]
    if args.deepspeed == "yes" or (args.deepspeed == "auto" and deepspeed_available()):
        if not deepspeed_available():
            p.error(
                "--deepspeed yes: `import deepspeed` fails; DS_BUILD_OPS=0 pip install deepspeed"
            )
        known += DEEPSPEED_CONTENDERS
    for n in (args.contenders or []) + args.profile + args.calls:
        if n not in known:
            p.error(f"unknown contender {n!r}; choose from {known}")
    if not args.contenders:
        args.contenders = known
    results = run_ranks(_worker, args.world_size, args)
    summary = report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
