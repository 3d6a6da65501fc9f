"""Timing helpers the benchmark scripts share (each script is run as
`python benchmarks/<name>.py`, so this directory is on `sys.path`).

Best-of timings: on a shared machine the least disturbed run is the closest to what the code
costs; ratios are taken between implementations timed in the same rounds.
"""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], object], rounds: int) -> float:
    """The shortest of `rounds` timed calls of `fn`, in seconds."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def best_round_robin(impls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each implementation's shortest time, in seconds, after one warm-up call each (page faults,
    op loading, thread pools), taking turns for `repeats` rounds so a burst of load from other
    programs hits every implementation alike."""
    for fn in impls.values():
        fn()
    best = dict.fromkeys(impls, float("inf"))
    for _ in range(repeats):
        for name, fn in impls.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best
