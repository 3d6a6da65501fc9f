"""A tiny job for the launcher tests: every rank all-reduces its rank and writes what it saw;
`--fail-rank R --code C` makes rank R exit with code C after printing a traceback."""

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
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
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
    json.dump(
        {"world": dist.get_world_size(), "sum": t.item(), "node": os.environ["GROUP_RANK"]}, f
    )
dist.destroy_process_group()
