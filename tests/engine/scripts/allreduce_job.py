"""A tiny job for the launcher tests: every rank all-reduces its rank and writes what it saw;
`--fail-rank R --code C` makes rank R exit with code C after printing a traceback;
`--fail-rank R --uncaught` makes it raise a chained exception that nobody catches (after the
process group exists, so torch prefixes its stderr lines with `[rankR]: `). It declares
`--local_rank` as scripts written for DeepSpeed do, and records its command line."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--code", type=int, default=3)
parser.add_argument("--uncaught", action="store_true")
parser.add_argument("--local_rank", type=int, default=-1)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == args.fail_rank and args.uncaught:
    try:
        raise ValueError("the cause")
    except ValueError as e:
        raise RuntimeError(f"rank {rank} raised") from e
if rank == args.fail_rank:
    try:
        raise RuntimeError(f"rank {rank} was told to fail")
    except RuntimeError:
        import traceback

        traceback.print_exc()
        sys.exit(args.code)
t = torch.tensor([float(rank)])
dist.all_reduce(t)
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    seen = {"world": dist.get_world_size(), "sum": t.item(), "node": os.environ["GROUP_RANK"]}
    json.dump({**seen, "argv": sys.argv[1:], "LOCAL_RANK": os.environ["LOCAL_RANK"]}, f)
dist.destroy_process_group()
