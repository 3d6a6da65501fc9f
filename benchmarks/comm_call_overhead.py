"""Per-call overhead of minispeed.comm on small messages: our collectives against torch's.

Run from the repository root:

    .venv/bin/python benchmarks/comm_call_overhead.py                # 2 gloo processes
    .venv/bin/python benchmarks/comm_call_overhead.py --numel 4096 --rounds 9 --json out.json
    .venv/bin/python benchmarks/comm_call_overhead.py --profile 25   # where comm's time goes

Two tables of CPU time per call (`time.process_time`, the process's every thread: the caller's
Python and gloo's worker alike), each rank's mean over `--iters` calls, the best of `--rounds`
rounds (the least disturbed one on a shared machine), averaged over the 2 ranks. `world`: small
all_reduce / reduce_scatter / all_gather / broadcast (`--numel` fp32 elements per rank; 1,024 by
default) and the coalesced all-gather on the 2-rank world group, each synchronous and with
`async_op=True` (then `wait()`), as the bare `torch.distributed` call, as `minispeed.comm`'s with
the comms logger off (default cross-rank check mode `first`), and with a logger recording. The
variants take turns round by round, so a load change hits them alike. `solo`: the same calls on
a one-rank group, where the backend sends nothing, so the difference is comm's overhead alone.
The load average at start and end is printed with them, because a loaded machine moves every
number.

`--profile TOP` profiles instead (cProfile timed by `time.process_time`, rank 0, world group):
comm's synchronous all-reduce and reduce-scatter, logger off, and prints the TOP functions by
own time in microseconds per collective, so each microsecond of the overhead has a name.

To compare two versions of comm in one sitting, run the same script with the other version's
`packages/comm/src` first on `PYTHONPATH` (a second git worktree), alternating the runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import minispeed.comm as comm
from minispeed.comm import call
from minispeed.core.testing import run_distributed, shutdown_pool

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_gather_coalesced")
VARIANTS = ("torch", "comm", "comm+logger")


def _calls(group: Any, n: int, numel: int, async_op: bool) -> dict[str, Callable[[], Any]]:
    """op -> a function issuing one call of it on `group`, through `comm` (`"<op>"`) and bare
    torch.distributed (`"<op>/torch"`); async calls are waited on at once."""
    x = torch.ones(numel)
    gathered = torch.empty(n * numel)
    full = torch.ones(n * numel)
    part = torch.empty(numel)
    pieces = [torch.ones(numel // 4), torch.ones(numel // 4), torch.ones(numel // 2)]
    outs = [torch.empty(n * t.numel()) for t in pieces]
    flat = torch.empty(n * numel)
    root = dist.get_global_rank(group, 0) if group is not None else 0

    def waited(work: Any) -> None:
        if async_op:
            work.wait()

    def torch_coalesced() -> None:  # what comm's coalesced gather does, without its checks
        me = dist.get_rank(group)
        mine = flat[me * numel : (me + 1) * numel]
        torch.cat([t.reshape(-1) for t in pieces], out=mine)
        waited(call.ALL_GATHER_FLAT_NATIVE(flat, mine, group=group, async_op=async_op))
        by_rank, offset = flat.view(n, numel), 0
        for o, t in zip(outs, pieces):
            o.view(n, -1).copy_(by_rank[:, offset : offset + t.numel()])
            offset += t.numel()

    kw = {"group": group, "async_op": async_op}
    return {
        "all_reduce/torch": lambda: waited(dist.all_reduce(x, **kw)),
        "all_reduce": lambda: waited(comm.all_reduce(x, **kw)),
        "reduce_scatter/torch": lambda: waited(call.REDUCE_SCATTER_FLAT_NATIVE(part, full, **kw)),
        "reduce_scatter": lambda: waited(comm.reduce_scatter_tensor(part, full, **kw)),
        "all_gather/torch": lambda: waited(call.ALL_GATHER_FLAT_NATIVE(gathered, x, **kw)),
        "all_gather": lambda: waited(comm.all_gather_into_tensor(gathered, x, **kw)),
        "broadcast/torch": lambda: waited(dist.broadcast(x, root, **kw)),
        "broadcast": lambda: waited(comm.broadcast(x, root, **kw)),
        "all_gather_coalesced/torch": torch_coalesced,
        "all_gather_coalesced": lambda: waited(comm.all_gather_coalesced(outs, pieces, **kw)),
    }


def _best_us(fns: dict[str, Callable[[], Any]], iters: int, rounds: int, sync: bool) -> dict:
    """Best CPU microseconds per call of each variant (name -> fn; a name ending in `+logger`
    runs inside a fresh `CommsLogger` each round), variants taking turns each round."""
    for name, fn in fns.items():  # warm-up: connections, the first call's cross-rank check
        with comm.CommsLogger() if name.endswith("+logger") else _nothing():
            for _ in range(20):
                fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            if sync:
                dist.barrier()
            with comm.CommsLogger() if name.endswith("+logger") else _nothing():
                t0 = time.process_time()
                for _ in range(iters):
                    fn()
                per_call = (time.process_time() - t0) / iters
            best[name] = min(best[name], per_call * 1e6)
    return best


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _solo_group() -> Any:
    me, solo = dist.get_rank(), None
    for r in range(dist.get_world_size()):  # group creation is collective: every rank makes all
        g = dist.new_group([r])
        if r == me:
            solo = g
    return solo


def _body(rank: int, world_size: int, numel: int, iters: int, rounds: int) -> dict:
    solo = _solo_group()
    out: dict[str, list[dict]] = {"world": [], "solo": []}
    for table, group, n, sync in (("world", None, world_size, True), ("solo", solo, 1, False)):
        for async_op in (False, True):
            fns = _calls(group, n, numel, async_op)
            for op in OPS:
                us = _best_us(
                    {"torch": fns[f"{op}/torch"], "comm": fns[op], "comm+logger": fns[op]},
                    iters,
                    rounds,
                    sync,
                )
                out[table].append({"op": op, "async_op": async_op, **us})
    return out


def _profile_body(rank: int, world_size: int, numel: int, iters: int, top: int) -> str:
    fns = _calls(None, world_size, numel, async_op=False)
    report = io.StringIO()
    for op in ("all_reduce", "reduce_scatter"):
        for _ in range(50):
            fns[op]()
        dist.barrier()
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        for _ in range(iters):
            fns[op]()
        prof.disable()
        stats = pstats.Stats(prof, stream=io.StringIO())
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
        total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
        report.write(
            f"\n{op}, synchronous, logger off: {total / iters * 1e6:.1f} µs of CPU per call "
            f"under cProfile, {sum(v[1] for v in stats.stats.values()) / iters:.1f} calls "  # type: ignore[attr-defined]
            f"(cProfile's own cost inflates the Python share)\n"
            f"{'own µs/call':>12}{'calls/call':>11}  function\n"
        )
        for (path, line, name), (_cc, nc, tt, _ct, _callers) in rows[:top]:
            where = f"{os.path.basename(path)}:{line}" if line else path
            report.write(f"{tt / iters * 1e6:>12.2f}{nc / iters:>11.1f}  {name} ({where})\n")
    return report.getvalue() if rank == 0 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1024, help="fp32 elements per rank")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", type=int, default=0, metavar="TOP")
    parser.add_argument("--json", help="also write the tables to this JSON file")
    args = parser.parse_args(argv)
    if args.numel % 4:
        parser.error("--numel must be a multiple of 4 (the coalesced gather splits it 1:1:2)")
    load_before = os.getloadavg()
    if args.profile:
        text = run_distributed(
            _profile_body,
            world_size=2,
            args=(args.numel, args.iters * args.rounds, args.profile),
            timeout_s=600,
        )[0]
        shutdown_pool()
        print(f"gloo, 2 processes, {args.numel} fp32 per rank, torch {torch.__version__}")
        print(f"load average (1, 5, 15 min): before {load_before}, after {os.getloadavg()}")
        print(text)
        return 0
    per_rank = run_distributed(
        _body, world_size=2, args=(args.numel, args.iters, args.rounds), timeout_s=1200
    )
    shutdown_pool()
    load_after = os.getloadavg()
    result: dict[str, list[dict]] = {}
    for table, rows in per_rank[0].items():  # mean over the ranks, row by row
        result[table] = [
            {**r, **{v: sum(p[table][i][v] for p in per_rank) / len(per_rank) for v in VARIANTS}}
            for i, r in enumerate(rows)
        ]
    print(f"gloo, 2 processes, {args.numel} fp32 per rank, torch {torch.__version__}")
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")
    for table, rows in result.items():
        print(
            f"\n{table}: CPU microseconds per call, mean of the ranks' best of "
            f"{args.rounds} x {args.iters}"
        )
        print(
            f"{'op':<22}{'async':>6}{'torch':>9}{'comm':>9}{'+logger':>9}{'comm/torch':>11}"
            f"{'logger/torch':>13}"
        )
        for r in rows:
            print(
                f"{r['op']:<22}{'yes' if r['async_op'] else 'no':>6}{r['torch']:>9.1f}"
                f"{r['comm']:>9.1f}{r['comm+logger']:>9.1f}{r['comm'] / r['torch']:>11.2f}"
                f"{r['comm+logger'] / r['torch']:>13.2f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "load": [load_before, load_after], **result}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
