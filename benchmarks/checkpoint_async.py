"""Step-time cost of a checkpoint save: synchronous against `checkpoint.async_save`.

Run from the repository root (2 processes, ZeRO-1, 33.6M parameters by default):

    .venv/bin/python benchmarks/checkpoint_async.py
    .venv/bin/python benchmarks/checkpoint_async.py --layers 8 --width 2048 --rounds 3

Each round trains `--window` steps with no save (the baseline), then saves and trains the same
number of steps, once with a synchronous save and once with an asynchronous one (the modes in
turn, the order swapped every round). For each save it reports the time the save call blocks
the training loop and the *cost*: the extra wall time of the window over the baseline window,
counted until the checkpoint is durable (for the asynchronous save: the window's steps, plus any
wait at its end for the writer, so training that the writer slowed down is counted). Before
reporting, it checks that both tags are sealed and hold the same
bytes (both engines train the same steps on the same data).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from minispeed.core.testing import run_distributed, shutdown_pool


def _engine(layers: int, width: int, async_save: bool):
    import minispeed.engine as deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
        config={
            "train_batch_size": 8,
            "zero_optimization": {"stage": 1},
            "checkpoint": {"async_save": async_save},
        },
    )
    return engine


def _steps(engine, x, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        engine.backward(engine(x).square().mean())
        engine.step()
    return time.perf_counter() - start


def _body(rank, world_size, layers, width, window, rounds, root):
    import minispeed.comm as comm
    from minispeed.engine.checkpoint.background import checkpointer_of

    torch.set_num_threads(1)
    engines = {mode: _engine(layers, width, mode == "async") for mode in ("sync", "async")}
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
    for engine in engines.values():
        _steps(engine, x, 2)  # warm-up
    rows = []
    for r in range(rounds):
        for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            engine = engines[mode]
            comm.barrier()
            base = _steps(engine, x, window)
            comm.barrier()
            start = time.perf_counter()
            engine.save_checkpoint(os.path.join(root, mode), tag=f"r{r}")
            blocked = time.perf_counter() - start
            _steps(engine, x, window)
            checkpointer_of(engine).wait()  # durable (collective)
            total = time.perf_counter() - start
            rows.append({"mode": mode, "base": base, "blocked": blocked, "total": total})
    numel = sum(p.numel() for p in engines["sync"].module.parameters())
    return {"rows": rows, "numel": numel}


def _check(root: str, rounds: int) -> None:
    """Both engines train the same steps on the same data, so each round's sync and async tags
    must be sealed and hold the same bytes of weights and optimizer state."""
    from minispeed.zero.checkpoints.layout import read_metadata

    for r in range(rounds):
        tags = [os.path.join(root, mode, f"r{r}") for mode in ("sync", "async")]
        metas = [read_metadata(Path(t)) for t in tags]
        assert metas[0].shards == metas[1].shards
        for shard in metas[0].shards:
            for name in (shard.weights_file, shard.optim_file):
                a, b = (torch.load(os.path.join(t, name), weights_only=True) for t in tags)
                assert _flat(a) == _flat(b), f"round {r}: {name} differs between sync and async"


def _flat(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj.numel(), obj.double().sum().item(), obj.abs().double().sum().item()]
    if isinstance(obj, dict):
        return [(k, _flat(v)) for k, v in sorted(obj.items()) if k != "rng"]
    return [obj]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--window", type=int, default=6, help="steps after each save")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("CKPT_BENCH_DIR")) as root:
        results = run_distributed(
            _body,
            world_size=2,
            args=(args.layers, args.width, args.window, args.rounds, root),
            timeout_s=1800,
        )
        _check(root, args.rounds)
        size = sum(
            os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(os.path.join(root, "sync", "r0"))
            for f in fs
        )
    shutdown_pool()
    rows = results[0]["rows"]  # rank 0's clock; every phase ends in a collective
    load = os.getloadavg()[0]
    print(
        f"{results[0]['numel'] / 1e6:.1f}M parameters, ZeRO-1 on 2 processes, checkpoint "
        f"{size / 2**20:.0f} MiB per tag, window {args.window} steps, load average {load:.2f}"
    )
    for i, row in enumerate(rows):
        print(
            f"round {i // 2} {row['mode']:>5}: window {row['base']:.2f} s without a save, "
            f"{row['total']:.2f} s with one (the call blocked {row['blocked']:.2f} s)"
        )
    print("| save | step (ms, median) | blocks the loop (s) | cost over the window (s) |")
    print("|---|---|---|---|")
    for mode in ("sync", "async"):
        mine = [row for row in rows if row["mode"] == mode]
        step = statistics.median(row["base"] / args.window for row in mine)
        blocked = statistics.median(row["blocked"] for row in mine)
        cost = statistics.median(row["total"] - row["base"] for row in mine)
        print(f"| {mode} | {step * 1e3:.0f} | {blocked:.2f} | {cost:.2f} |")


if __name__ == "__main__":
    main()
