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

__all__ = ["STAYS_HERE", "Residency", "Resident", "ShardHome", "StaysHere"]


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


class Resident:
    """Where a `ShardedParam`'s shard lives: the `Residency` state and its home, and the only
    methods that change them (`ShardedParam`'s base; the home calls `to_away` / `to_fetched` /
    `to_here`, offload's set-up calls `set_home`). Orthogonal to `ParamState`: the gather path
    only asks the home to ``fetch`` and ``evict`` (no-ops for `STAYS_HERE`)."""

    name: str
    shard: torch.Tensor
    shard_numel: int

    def __init__(self) -> None:
        self._residency = Residency.HERE
        self._home: ShardHome = STAYS_HERE

    @property
    def residency(self) -> Residency:
        """Where the shard is now: HERE, AWAY in its home, or FETCHED (`Residency`)."""
        return self._residency

    @property
    def away(self) -> bool:
        """Whether the shard's value is in its home only (`Residency.AWAY`; 0 bytes here)."""
        return self._residency is Residency.AWAY

    @property
    def home(self) -> ShardHome:
        """Where the shard lives while released: `STAYS_HERE`, or offload's home for it."""
        return self._home

    # -- transitions (called by the parameter's home) ----------------------------------------------
    def to_away(self, home: ShardHome | None = None) -> None:
        """The shard's value is in its home: drop it here (0 bytes). From HERE, adopted by
        ``home`` (which now holds the value), or from FETCHED (evicted; same home)."""
        was = self._residency
        adopted = was is Residency.HERE and home is not None and self._home is STAYS_HERE
        evicted = was is Residency.FETCHED and home in (None, self._home)
        assert adopted or evicted, f"{self.name}: to_away from {was}"
        self._home = home or self._home
        self.shard = self.shard.new_empty(0)
        self._residency = Residency.AWAY

    def to_fetched(self, shard: torch.Tensor) -> None:
        """AWAY -> FETCHED: ``shard`` (``shard_numel`` elements) holds the value read from home."""
        assert self._residency is Residency.AWAY, f"{self.name}: to_fetched from {self._residency}"
        assert shard.numel() == self.shard_numel, f"{self.name}: fetched {shard.numel()} elements"
        self.shard = shard
        self._residency = Residency.FETCHED

    def to_here(self) -> None:
        """FETCHED -> HERE: the shard stays in memory for good and has no home any more."""
        assert self._residency is Residency.FETCHED, f"{self.name}: to_here from {self._residency}"
        self._home = STAYS_HERE
        self._residency = Residency.HERE

    def set_home(self, home: ShardHome) -> None:
        """A home over the old one (ZeRO-Infinity's: also writes the master); same residency."""
        self._home = home
