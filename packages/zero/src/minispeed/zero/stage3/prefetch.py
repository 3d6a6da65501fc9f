"""The look-ahead of stage 3: what to fetch before it is needed, and what to keep for reuse.

Given the units that come next in the followed trace (trace.py), `Prefetcher` decides which of
their parameters to gather ahead (`chunks`: the rest of the pass, or the next unit), within two
budgets: the parameters fetched ahead fit in ``stage3_prefetch_bucket_numel`` elements (and one
chunk, unless they are one unit), and the gathered total stays within
``stage3_max_live_numel``. It keeps the *live set* (the non-persistent parameters the coordinator
gathered and has not yet seen released) from which that total is counted, and decides which
parameters of an ending unit stay gathered because a unit soon after needs them again (`keep`,
Note [reuse distance]). It issues nothing: the coordinator (coordinator.py) turns its answers
into all-gathers and releases.

Costs: one pass over the upcoming units' parameters per module start (`chunks`), one per module
end (`keep`), each stopping at its budget; `live_numel` walks the live set.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from minispeed.zero.stage3.params import FetchUnit, ParamState, ShardedParam

__all__ = ["Prefetcher"]

# Note [reuse distance]
# A module called twice in one pass (a block applied twice, a weight shared by two modules) would
# be fetched, released and fetched again. ``stage3_max_reuse_distance`` (parameter elements, as
# DeepSpeed's key) keeps gathered those parameters of an ending unit that a unit starting later in
# the same pass needs again, if fewer than that many parameter elements are needed in between:
# the upcoming units' parameters are summed in trace order and the scan stops at the distance, as
# DeepSpeed's coordinator counts. Only while following a trace: the decision is a function of
# the trace position, so every rank makes it identically (a diverging rank replaying the trace
# too). Only within one pass: the end of a forward releases everything, so parameters are not
# carried from forward into backward (DeepSpeed does carry them; here a forward that no backward
# follows, such as evaluation, holds nothing afterwards). Kept parameters stay in the live set
# (``stage3_max_live_numel``) and go at their last use or at the end of the pass. Cost: the
# unit's bytes held in between; saved: one all-gather of them per reuse.


# Note [a prefetch stays one chunk ahead]
# What is gathered ahead of the running modules is the rest of the pass when it fits
# ``stage3_prefetch_bucket_numel`` elements and one chunk, ``chunk_numel`` (4M elements: 16 MiB in
# fp32), whichever is smaller; otherwise the next unit alone (if the budget holds it, even where
# it is larger than the chunk). It travels as one async all-gather, issued at a module start, and
# each later module start tops it up. DeepSpeed's default budget, 5e7 elements, is a whole
# 34M-parameter model. Admitted at once as one all-gather, the first backward module waited for
# the whole model (0.23 s per step at 33.9M); cut into chunks all issued at once, nobody waited,
# but the first module of backward started with every block gathered or in flight on top of the
# forward's activations, the moment they peak: 129 MiB more than one chunk at 33.9M, a
# steady-state peak 1.18x FSDP2's (benchmarks/zero_vs_torch.py, docs/benchmarks.md). On gloo a
# unit's transfer takes milliseconds against its compute of tens, so one unit ahead hides it.
# Why one unit and not a chunk's worth when the rest does not fit: the window slides, so every
# module start issues a top-up either way; a deeper window saves no call and only holds more at
# backward's start (at 33.9M a chunk's 10.7 MiB against one unit's 5.3: peak 524.8 -> 519.5 MiB
# per rank). Why the rest of the pass when it fits: that saves the calls, one all-gather per pass
# instead of one per unit (at 3.2M parameters, 12 gathered weights: holding them all is 9.5 MiB
# more at the peak than one unit ahead, and saves 22 calls a step, 0-30 ms of CPU in loaded runs).
# Before, a unit larger than the window stopped the prefetch: nothing was gathered ahead of it.
# Bytes are the same either way.
_GATHER_CHUNK_NUMEL = 1 << 22  # 4M elements: 16 MiB in fp32


class Prefetcher:
    """Fetch-ahead and reuse decisions within the prefetch, live and reuse budgets.

    ``stats`` is the coordinator's `FetchStats` (``peak_live_numel``, ``live_budget_stops``).
    ``chunk_numel``: the most a prefetch gathers ahead in one call, below the prefetch budget,
    where it holds the rest of the pass; else one unit ahead (Note [a prefetch stays one chunk
    ahead]); a plain attribute, so a test can make chunks small.
    """

    def __init__(
        self, prefetch_numel: int, max_live_numel: int, reuse_numel: int, stats: Any
    ) -> None:
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.reuse_numel = reuse_numel
        self.chunk_numel = _GATHER_CHUNK_NUMEL
        self.stats = stats
        self._live: dict[ShardedParam, None] = {}  # non-persistent params the coordinator fetched

    # -- the live set -----------------------------------------------------------------------------
    def track(self, sps: list[ShardedParam]) -> None:
        """The coordinator gathered (or started gathering) ``sps``: count them as live."""
        for sp in sps:
            if not sp.persistent:
                self._live[sp] = None
        self.stats.peak_live_numel = max(self.stats.peak_live_numel, self.live_numel())

    def live_numel(self) -> int:
        """Elements gathered now among those tracked (forgetting the ones released since)."""
        for sp in [sp for sp in self._live if sp.state is ParamState.SHARDED]:
            del self._live[sp]
        return sum([sp.padded_numel for sp in self._live])  # a list: no generator to resume

    def live(self) -> list[ShardedParam]:
        """The tracked parameters (gathered, in flight, or released since the last count)."""
        return list(self._live)

    # -- the decisions ----------------------------------------------------------------------------
    def chunks(self, upcoming: Iterable[FetchUnit]) -> list[list[ShardedParam]]:
        """What to gather ahead: the rest of the pass if it fits the prefetch window (the budget,
        at most one chunk) and the live budget, else the next unit alone (Note [a prefetch stays
        one chunk ahead]); whole units in trace order; one all-gather's parameters, or none.

        The window counts the upcoming units' parameters that no running module holds (already
        in flight or not), so it slides: each module start tops it up by what was consumed.
        """
        window = min(self.prefetch_numel, self.chunk_numel)
        ahead, seen, batch, first = 0, set(), [], None
        live = self.live_numel()
        sharded = ParamState.SHARDED
        for unit in upcoming:
            # One pass over the unit's parameters: those no running module holds count against
            # the window (fresh); the SHARDED among them are what a gather must fetch (missing).
            numel, missing, extra = 0, [], 0
            for sp in unit.params:
                if sp.persistent or sp.holds or sp in seen:
                    continue
                seen.add(sp)
                numel += sp.padded_numel
                if sp.state is sharded:
                    missing.append(sp)
                    extra += sp.padded_numel
            over = ahead + numel > window and not (first is None and numel <= self.prefetch_numel)
            if over or live + extra > self.max_live_numel:
                # The rest of the pass does not fit: one unit ahead, no more (a deeper window
                # would hold more and save no call: it is topped up at every module start).
                self.stats.live_budget_stops += not over
                return [first] if first else []
            ahead, live = ahead + numel, live + extra
            batch += missing
            if numel and first is None:
                first = missing
        return [batch] if batch else []

    def keep(self, unit: FetchUnit, upcoming: Iterable[FetchUnit]) -> set[ShardedParam]:
        """``unit``'s parameters that a unit within ``reuse_numel`` elements needs again
        (Note [reuse distance]); ``upcoming`` is empty unless a trace is followed."""
        mine, keep, seen = set(unit.params), set(), 0
        for later in upcoming:
            if seen >= self.reuse_numel:
                break
            for sp in later.params:
                if sp in mine:
                    keep.add(sp)
                seen += sp.padded_numel
        return keep
