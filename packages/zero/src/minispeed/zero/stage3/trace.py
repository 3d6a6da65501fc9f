"""Cross-rank checks of the fetch order: what makes a ZeRO-3 divergence an error, not a hang.

Collectives pair up by issue order. If ranks run parameter-owning modules in different orders,
rank 0's all-gather of module A meets rank 1's all-gather of module B: a hang, or garbage when the
sizes happen to match. :func:`agree_across_ranks` is the check the coordinator runs at chosen
points of a pass: every rank contributes (phase, position, fingerprint of what it is about to do);
if any differ, all ranks learn it from the same collective and raise :class:`FetchOrderError`
together, naming what each rank ran at the first position where they differ.

Costs: one all-gather of 3 int64 per rank (``24·N`` bytes message) per check; on a mismatch one
more ``all_gather_object`` of the descriptions (the run is over anyway).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from typing import Any

import torch

import minispeed.comm as comm
from minispeed.core.accelerator import get_accelerator

__all__ = ["FetchOrderError", "TraceCheck", "agree_across_ranks"]

# Note [how divergence is caught]
# * While a trace is being recorded (the first forward, or after a change of control flow), every
#   module start is preceded by a tiny all-gather of (phase, position, fingerprint of the module
#   name). The fetch that would pair wrongly is never issued: all ranks see the mismatch in the
#   same collective and raise together. Cost: one 24·N-byte collective per module, once.
# * Later forwards follow the verified trace and issue *exactly* the trace's collectives (fetches
#   and prefetches are a function of the trace position). A rank whose next module differs from
#   the trace knows it at once, and knows which collectives the others will issue until the end
#   of the forward: the trace's. It *replays* them (gathers and releases, no compute), so nobody
#   waits on a missing partner, then joins the one check every rank makes at the end of each
#   forward with (position, module) of its divergence. Everyone raises there, naming the module.
#   If every rank diverged identically (eval-only branch, a data-dependent branch all ranks took),
#   nothing is wrong: the trace is dropped and re-recorded, with checks, for the rest of the pass.
# * Backward order is a function of the forward graph, already checked, so backward is checked
#   only in ``every`` mode; a backward that leaves its trace just stops prefetching (all ranks
#   leave it at the same point) and records a new trace next time.
# * Not detectable: ranks that run the same modules but read different parameters in them
#   without our hooks seeing it, or give different parameters gradients (reduce-scatter buckets
#   then differ). Use set_leaf_module for modules with data-dependent children.


class FetchOrderError(RuntimeError):
    """Ranks run parameter-owning modules in different orders (raised on every rank)."""


class TraceCheck(enum.Enum):
    """How much cross-rank checking of the fetch order runs (see Note [how divergence is caught])."""

    OFF = "off"  # nothing; a divergence hangs until the collective timeout
    FIRST = "first"  # every module start while recording, then one check per forward
    EVERY = "every"  # every module start and backward start of every pass (debug)

    @classmethod
    def from_config(cls, config: Any) -> TraceCheck:
        """``MINISPEED_ZERO3_TRACE_CHECK`` when set (a one-run override), else the config's field."""
        value = os.environ.get("MINISPEED_ZERO3_TRACE_CHECK") or config.stage3_trace_check
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"stage-3 trace check {value!r} is not one of {[m.value for m in cls]}; "
                f"set ZeroConfig.stage3_trace_check (or MINISPEED_ZERO3_TRACE_CHECK) to 'first' "
                f"(default), 'every' (debug) or 'off'"
            ) from None


_PHASE_CODE = {"forward": 1, "backward": 2, "call": 3, "end": 4}

# Note [the grad mode is part of the end-of-forward check]
# Every forward follows the same trace, so ranks that run *different numbers* of forwards (an
# evaluation loop over 3 batches on one rank and 5 on another) pass every module check: their
# passes pair up one by one. The mismatch surfaces when one rank goes back to training while the
# other still evaluates: its backward's all-gathers and reduce-scatters meet the other's forward
# all-gathers (gloo aborts a process on the size mismatch). So the one check every forward makes
# at its end carries the grad mode: the first pass where one rank trains and another evaluates
# raises on every rank, before any backward collective. (Uneven passes that are all evaluations
# and end in a collective of the user's own are beyond our sight.)


def agree_across_ranks(
    group: Any,
    phase: str,
    pos: int,
    fingerprint: int,
    what: str,
    describe: Callable[[str, int], str],
) -> None:
    """All-gather (phase, position, fingerprint); on any mismatch raise on every rank.

    ``what`` describes this rank's event at ``pos``; ``describe(phase, p)`` what this rank ran at
    an earlier position ``p`` (used when another rank diverged before this one's ``pos``).
    """
    n = comm.get_world_size(group)
    device = get_accelerator().device()
    mine = torch.tensor([_PHASE_CODE[phase], pos, fingerprint], dtype=torch.int64, device=device)
    rows = torch.empty(3 * n, dtype=torch.int64, device=device)  # rank-major (n, 3)
    comm.all_gather_into_tensor(rows, mine, group=group)
    table = rows.view(n, 3).tolist()
    if all(row == table[0] for row in table):
        return
    first_pos = min(row[1] for row in table)
    mine_text = what if pos == first_pos else describe(phase, first_pos)
    whats = comm.all_gather_object(mine_text, group=group)
    lines = "\n".join(f"  rank {r}: {w}" for r, w in enumerate(whats))
    if all(row[:2] == [_PHASE_CODE["end"], first_pos] for row in table):
        raise FetchOrderError(
            f"stage 3: ranks ran different numbers of forward passes, or the same pass with and "
            f"without gradients, so one rank's backward collectives would meet another's forward "
            f"(a hang or a crash). At the end of the same forward pass:\n{lines}\nEvery rank "
            f"must run the same number of forwards, each in the same grad mode: evaluate the same "
            f"number of batches on every rank (pad or drop the uneven last batch, e.g. "
            f"DistributedSampler(drop_last=True)), and use torch.no_grad() on all ranks or none"
        )
    raise FetchOrderError(
        f"stage 3: ranks run the modules that own parameters in different orders, so their "
        f"parameter all-gathers would pair up wrongly and hang. First difference ({phase} "
        f"position {first_pos}):\n{lines}\nEvery rank must call those modules in the same "
        f"order. Fix: make the control flow the same on every rank (run every branch, mask the "
        f"result), or mark the module whose children are chosen by data with "
        f"zero.set_leaf_module(module) so its whole subtree is fetched at once before it runs"
    )
