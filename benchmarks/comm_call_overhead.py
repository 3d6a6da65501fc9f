"""Per-call overhead of minispeed.comm on small messages: our collectives against torch's.

Run from the repository root:

    .venv/bin/python benchmarks/comm_call_overhead.py            # 2 gloo processes
    .venv/bin/python benchmarks/comm_call_overhead.py --rounds 9 --json out.json

Two tables. `world`: small all_reduce / all_gather / reduce_scatter / all_gather_coalesced
(64 fp32 elements per rank) on the 2-rank world group, torch.distributed and minispeed.comm
(logger off, default cross-rank check mode `first`) taking turns round by round; the difference
is what comm adds to a real call, within the network's noise. `solo`: the same calls on a
one-rank group, where the backend sends nothing, so the difference is comm's overhead alone.
Each figure is the best of `--rounds` rounds of `--iters` calls (the least disturbed round on a
shared machine); the load average at start and end is printed with them, because a loaded
machine moves every number.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import minispeed.comm as comm
from minispeed.comm import call
from minispeed.core.testing import run_distributed, shutdown_pool

NUMEL = 64  # fp32 elements per rank: small enough that the call, not the bytes, is timed


def _calls(group: Any, n: int) -> dict[str, dict[str, Callable[[], Any]]]:
    """op -> {"torch": fn, "comm": fn}, each issuing one synchronous call on `group`."""
    x = torch.ones(NUMEL)
    gathered = torch.empty(n * NUMEL)
    full = torch.ones(n * NUMEL)
    part = torch.empty(NUMEL)
    pieces = [torch.ones(NUMEL // 4), torch.ones(NUMEL // 4), torch.ones(NUMEL // 2)]
    outs = [torch.empty(n * t.numel()) for t in pieces]
    flat = torch.empty(n * NUMEL)

    def torch_coalesced() -> None:  # what comm's coalesced gather does, without its checks
        me = dist.get_rank(group)
        mine = flat[me * NUMEL : (me + 1) * NUMEL]
        torch.cat([t.reshape(-1) for t in pieces], out=mine)
        call.ALL_GATHER_FLAT_NATIVE(flat, mine, group=group)
        by_rank, offset = flat.view(n, NUMEL), 0
        for o, t in zip(outs, pieces):
            o.view(n, -1).copy_(by_rank[:, offset : offset + t.numel()])
            offset += t.numel()

    return {
        "all_reduce": {
            "torch": lambda: dist.all_reduce(x, group=group),
            "comm": lambda: comm.all_reduce(x, group=group),
        },
        "all_gather": {
            "torch": lambda: call.ALL_GATHER_FLAT_NATIVE(gathered, x, group=group),
            "comm": lambda: comm.all_gather_into_tensor(gathered, x, group=group),
        },
        "reduce_scatter": {
            "torch": lambda: call.REDUCE_SCATTER_FLAT_NATIVE(part, full, group=group),
            "comm": lambda: comm.reduce_scatter_tensor(part, full, group=group),
        },
        "all_gather_coalesced": {
            "torch": torch_coalesced,
            "comm": lambda: comm.all_gather_coalesced(outs, pieces, group=group),
        },
    }


def _best_us(fns: dict[str, Callable[[], Any]], iters: int, rounds: int, sync: bool) -> dict:
    """Best mean microseconds per call of each variant, variants taking turns each round."""
    for fn in fns.values():  # warm-up: connections, the first call's cross-rank check
        for _ in range(20):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            if sync:
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            per_call = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            if sync:  # the slowest rank's time is the call's time
                dist.all_reduce(per_call, op=dist.ReduceOp.MAX)
            best[name] = min(best[name], float(per_call) * 1e6)
    return best


def _body(rank: int, world_size: int, iters: int, rounds: int) -> dict[str, list[dict]]:
    me = dist.get_rank()
    solo = None
    for r in range(world_size):  # group creation is collective: every rank makes every group
        g = dist.new_group([r])
        if r == me:
            solo = g
    out: dict[str, list[dict]] = {"world": [], "solo": []}
    for table, group, n, sync in (("world", None, world_size, True), ("solo", solo, 1, False)):
        for op, fns in _calls(group, n).items():
            us = _best_us(fns, iters, rounds, sync)
            out[table].append({"op": op, **us, "overhead_us": us["comm"] - us["torch"]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="also write the tables to this JSON file")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    result = run_distributed(_body, world_size=2, args=(args.iters, args.rounds), timeout_s=600)[0]
    shutdown_pool()
    load_after = os.getloadavg()
    print(f"gloo, 2 processes, {NUMEL} fp32 per rank, torch {torch.__version__}")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    for table, rows in result.items():
        print(f"\n{table}: microseconds per call (best of {args.rounds} x {args.iters})")
        print(f"{'op':<22}{'torch':>10}{'comm':>10}{'comm-torch':>12}")
        for r in rows:
            print(f"{r['op']:<22}{r['torch']:>10.1f}{r['comm']:>10.1f}{r['overhead_us']:>12.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": [load_before, load_after], **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
