"""Per-call cost of finding a compiled op: asking its builder against `OpLoader`'s cache.

Run from the repository root:

    .venv/bin/python benchmarks/op_lookup.py

Core's cast and offload's CPU Adam used to ask their builder on every kernel call
(`load_or_fallback(builder)`: flags fingerprinted, compiler found); they now go through
`OpLoader.load`, as every op does. Each figure is the best of five rounds (the least disturbed
round on a shared machine); the load average is printed with them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from minispeed.core.op_builder import load_or_fallback
from minispeed.core.ops import cast
from minispeed.offload import ops as offload_ops


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    fn()  # built or loaded once, outside the timing
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    """Print one row per way of finding the op."""
    cpu = torch.device("cpu")
    cast_builder, offload_builder = cast.CastBuilder(), offload_ops.OffloadBuilder()
    rows = [
        ("cast: ask the builder", lambda: load_or_fallback(cast_builder), 300),
        ("cast: OpLoader", lambda: cast._op_for(cpu), 3000),
        ("offload: ask the builder", lambda: load_or_fallback(offload_builder), 300),
        ("offload: OpLoader", offload_ops.load_op, 3000),
    ]
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    for name, fn, calls in rows:
        print(f"{name:28s} {_per_call_us(fn, calls):8.2f} µs per call")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
