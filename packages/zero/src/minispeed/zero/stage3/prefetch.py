"""The look-ahead of stage 3: what to fetch before it is needed, and what to keep for reuse.

Given the units that come next in the followed trace (trace.py), `Prefetcher` decides which of
their parameters to gather ahead (`chunks`), within two budgets: the parameters fetched ahead fit
in ``stage3_prefetch_bucket_numel`` elements, and the gathered total stays within
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
# What is gathered ahead of the running modules fits ``stage3_prefetch_bucket_numel`` elements
# and one chunk, ``chunk_numel`` (4M elements: 16 MiB in fp32), whichever is smaller; it travels
# as one async all-gather, issued at a module start, and the window slides: each later module
# start tops it up by what was claimed since. DeepSpeed's default budget, 5e7 elements, is a whole
# 34M-parameter model. Admitted at once as one all-gather, the first backward module waited for
# the whole model (0.23 s per step at 33.9M); cut into chunks all issued at once, nobody waited,
# but the first module of backward started with every block gathered or in flight on top of the
# forward's activations, the moment they peak: 129 MiB more than one chunk at 33.9M, a
# steady-state peak 1.18x FSDP2's (benchmarks/zero_vs_torch.py, docs/benchmarks.md). On gloo a
# chunk's transfer takes milliseconds against a block's compute of a second, so one chunk ahead
# hides the transfer as well as the whole model ahead did. Cost: with a budget above the chunk,
# about one all-gather per module with parameters (a ~0.1 ms call each on gloo) instead of one per
# chunk; bytes are the same.
_GATHER_CHUNK_NUMEL = 1 << 22  # 4M elements: 16 MiB in fp32


class Prefetcher:
    """Fetch-ahead and reuse decisions within the prefetch, live and reuse budgets.

    ``stats`` is the coordinator's `FetchStats` (``peak_live_numel``, ``live_budget_stops``).
    ``chunk_numel`` caps what is gathered ahead below the prefetch budget (Note [a prefetch
    stays one chunk ahead]); a plain attribute, so a test can make chunks small.
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
        """What to gather ahead: the next units that fit the prefetch window (the budget, at most
        one chunk: Note [a prefetch stays one chunk ahead]) and the live budget, whole units in
        trace order; one all-gather's parameters, or none.

        The window counts the upcoming units' parameters that no running module holds (already
        in flight or not), so it slides: each module start tops it up by what was consumed.
        """
        window = min(self.prefetch_numel, self.chunk_numel)
        ahead, seen, batch = 0, set(), []
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
            if ahead + numel > window:
                break
            if live + extra > self.max_live_numel:
                self.stats.live_budget_stops += 1
                break
            ahead, live = ahead + numel, live + extra
            batch += missing
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
