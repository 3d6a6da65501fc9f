"""What the released-parameter guard costs a ZeRO-3 step (stage3/released.py): 2 gloo processes.

Two ZeRO-3 trainers over `examples/gpt.py`'s GPT, built from the same seed and fed the same
batches: one as `zero.shard` leaves it (every parameter guarded: its class has a
``__torch_function__`` that answers or raises when the parameter is read while released), one
with the guard taken off again (`released.unguard_param` on every parameter, the class
``zero.shard`` found). They take turns, one step each, for ``--rounds`` rounds after
``--warmup`` steps each; a step is forward, backward, optimizer step, and starts after a barrier;
its time is the slower rank's. Reported: each trainer's median step, the median over rounds of
(guarded / unguarded) with its range, and a cost that does not depend on load: the guard's calls
per step (counted on rank 0) times the price of one call, timed on a gathered parameter
(``--calls`` calls of ``p.dtype`` with and without the guard). Both trainers must produce the
same losses (the guard changes no number).

Run (the figures in docs/benchmarks.md):

```bash
python benchmarks/zero_released_access.py                 # 33.9M parameters ("large")
python benchmarks/zero_released_access.py --size small    # 3.2M
```
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from data import CharDataset  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from zerobench.ranks import run_ranks  # noqa: E402

# (n_layer, n_head, n_embd, block_size, micro_batch): zero_vs_torch.py's presets
SIZES = {"small": (4, 4, 256, 64, 8), "large": (8, 8, 592, 256, 4)}


def _trainer(args: argparse.Namespace, vocab: int, guarded: bool) -> tuple[Any, Any]:
    import minispeed.zero as zero
    from minispeed.zero.stage3.released import unguard_param

    n_layer, n_head, n_embd, block_size, _ = SIZES[args.size]
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd
    )
    model = GPT(cfg)
    opt = zero.shard(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
        config=zero.ZeroConfig(stage=3),
    )
    if not guarded:
        for p in model.parameters():
            unguard_param(p)
    return model, opt


def _step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    import minispeed.comm as comm

    comm.barrier()
    start = time.perf_counter()
    loss = model(x, y)[1]
    opt.backward(loss)
    opt.step()
    t = torch.tensor([time.perf_counter() - start])
    comm.all_reduce(t, op=comm.ReduceOp.MAX)
    return t.item(), loss.item()


def _calls_per_step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> int:
    """How many times the guard's ``__torch_function__`` runs in one step."""
    from minispeed.zero.stage3 import released

    count = 0
    original = released._torch_function

    def counting(*a: Any, **k: Any) -> Any:
        nonlocal count
        count += 1
        return original(*a, **k)

    for cls in released._GUARDED_TYPES:
        cls.__torch_function__ = classmethod(counting)
    try:
        _step(model, opt, x, y)
    finally:
        for cls in released._GUARDED_TYPES:
            cls.__torch_function__ = classmethod(original)
    return count


def _call_price_s(calls: int) -> float:
    """Seconds one guard call adds: ``p.dtype`` on a gathered guarded parameter minus on a plain
    one (best of 5 loops of ``calls`` reads each)."""
    import minispeed.comm as comm
    from minispeed.zero.stage3.init import GatheredParameters
    from minispeed.zero.stage3.params import partition_param
    from minispeed.zero.stage3.released import guard_param

    plain = torch.nn.Parameter(torch.zeros(64))
    guarded = torch.nn.Parameter(torch.zeros(64))
    guard_param(guarded, partition_param(guarded, None))

    def loop(p: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                p.dtype  # noqa: B018
            best = min(best, time.perf_counter() - start)
        return best / calls

    with GatheredParameters(guarded):
        price = loop(guarded) - loop(plain)
    comm.barrier()
    return price


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    os.environ.setdefault("MINISPEED_ACCELERATOR", "cpu")
    torch.set_num_threads(args.threads)
    import minispeed.comm as comm

    comm.init_distributed(backend="gloo")
    dataset = CharDataset.from_file()
    block_size, micro = SIZES[args.size][3], SIZES[args.size][4]
    n = args.warmup + args.rounds
    batches = [
        dataset.batch("train", i, micro * world, block_size, 0, rank, world) for i in range(n)
    ]
    trainers = {g: _trainer(args, dataset.tokenizer.vocab_size, g) for g in (True, False)}
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[float]] = {True: [], False: []}
    for i, (x, y) in enumerate(batches):
        order = (True, False) if i % 2 == 0 else (False, True)
        for guarded in order:
            t, loss = _step(*trainers[guarded], x, y)
            losses[guarded].append(loss)
            if i >= args.warmup:
                times[guarded].append(t)
    calls = _calls_per_step(*trainers[True], *batches[0])
    price = _call_price_s(args.calls)
    params = sum(p.numel() for p in trainers[True][0].parameters())  # full shapes: guarded
    queue.put((rank, dict(times=times, losses=losses, calls=calls, price=price, params=params)))
    comm.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="large")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--calls", type=int, default=200_000, help="guard calls timed for the price")
    args = p.parse_args()
    results = run_ranks(_worker, 2, args)
    r0 = results[0]
    on, off = r0["times"][True], r0["times"][False]
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    med_on, med_off = statistics.median(on), statistics.median(off)
    added = r0["calls"] * r0["price"]
    print(f"ZeRO-3 step, {r0['params'] / 1e6:.1f}M parameters, 2 ranks, {args.rounds} rounds")
    print(f"  guarded   median {med_on * 1e3:8.1f} ms")
    print(f"  unguarded median {med_off * 1e3:8.1f} ms")
    print(
        f"  guarded / unguarded: median {statistics.median(ratios):.4f} "
        f"(range {min(ratios):.4f}-{max(ratios):.4f})"
    )
    print(
        f"  guard calls per step {r0['calls']} x {r0['price'] * 1e6:.2f} us = "
        f"{added * 1e3:.2f} ms = {100 * added / med_off:.3f} % of the unguarded step"
    )
    same = r0["losses"][True] == r0["losses"][False]
    print(f"  losses identical: {same}")
    if not same:
        raise SystemExit("the guard changed the losses")


if __name__ == "__main__":
    main()
