"""Where a released stage-3 shard lives: `Residency` (a state of `ShardedParam`) and `ShardHome`.

Stage 3 keeps each rank's shard (``s`` elements, ``p`` bytes each) on the accelerator unless
``offload_param`` gives it a *home* elsewhere (host memory or a swap file:
stage3/offloaded.py; the optimizer's files too under ZeRO-Infinity: stage3/infinity.py).
This module is the small interface stage 3 needs from such a home; it imports nothing of
`minispeed.offload`, so zero does not depend on the optional package: the homes implement
`ShardHome` and are chosen once, at ``zero.shard`` (or ``zero.Init(config)``).

Every `ShardedParam` has a home: `STAYS_HERE` (the shard never leaves, every call a no-op) until
offload gives it another, so the gather path calls ``sp.home.fetch(sp)`` and
``sp.home.evict(sp)`` without asking whether offload is on (see Note [optional features are
chosen once] in stage3/strategy.py).
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

import torch

# The methods take a params.ShardedParam; not imported (params.py imports this module).
ShardedParam = Any

__all__ = ["STAYS_HERE", "Residency", "ShardHome", "StaysHere"]


class Residency(enum.Enum):
    """Where a parameter's shard (``s`` elements, ``p`` bytes each) is. A state of `ShardedParam`
    (``sp.residency``), orthogonal to `ParamState`; changed only by its asserting methods
    ``to_away`` / ``to_fetched`` / ``to_here``, which the parameter's home calls.

    | state | where the shard's value is | bytes here for the shard |
    |---|---|---|
    | HERE | ``sp.shard`` only (no home, or the home keeps no copy of its own) | ``s·p`` |
    | AWAY | the home (host memory or a swap file); ``sp.shard`` is empty | 0 |
    | FETCHED | the home, and a copy in ``sp.shard`` until the home evicts it | ``s·p`` |

    Transitions: HERE -> AWAY (the home adopted the shard), AWAY -> FETCHED (fetched before an
    all-gather or a write), FETCHED -> AWAY (evicted once gathered), FETCHED -> HERE (a shard that
    comes back for good: persistent, or kept by ``max_in_cpu``).
    """

    HERE = "here"
    AWAY = "away"
    FETCHED = "fetched"


class ShardHome(Protocol):
    """What stage 3 needs from where a shard lives while released (offload implements it).

    Each method takes the `ShardedParam` and moves it only through its ``to_*`` methods.
    Costs: `fetch` reads ``s·p`` bytes from the home when the shard is AWAY; `write` writes
    ``s·p``; `evict` frees ``s·p`` bytes here.
    """

    #: The record of failed file I/O that the step agrees on (stage3/io_failures.py), or None
    #: when the home does no file I/O.
    io_failures: Any

    def fetch(self, sp: ShardedParam) -> None:
        """Make ``sp.shard`` hold the shard's value (AWAY -> FETCHED); nothing if it does."""
        ...

    def evict(self, sp: ShardedParam) -> None:
        """The shard is not needed here now (its value is in the home): FETCHED -> AWAY."""
        ...

    def write(self, sp: ShardedParam, values: torch.Tensor) -> None:
        """``values`` (``s`` elements, any dtype) is the shard's new value: into the home,
        without making it resident (the optimizer step's new shards, a modifier's changes)."""
        ...


class StaysHere:
    """The home of a shard that never leaves the accelerator: nothing to fetch or evict."""

    io_failures = None

    def fetch(self, sp: ShardedParam) -> None:
        pass

    def evict(self, sp: ShardedParam) -> None:
        pass

    def write(self, sp: ShardedParam, values: torch.Tensor) -> None:
        if values is not sp.shard:
            sp.shard.copy_(values)


#: Every `ShardedParam`'s home until offload gives it another.
STAYS_HERE = StaysHere()
