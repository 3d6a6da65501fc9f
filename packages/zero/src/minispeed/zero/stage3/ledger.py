"""Stage 3's communication ledger: bytes per micro-step, as a formula the tests check exactly.

Message sizes follow the comms logger (nccl-tests convention): an all-gather counts its gathered
output, a reduce-scatter its input. Each rank *sends* (N-1)/N of these (ring).

For one unique parameter of ``n`` elements on N ranks, padded to ``N·ceil(n/N)`` elements
(p, g = bytes per parameter / reduced-gradient element):

| when | collective | message bytes |
|---|---|---|
| forward | all-gather, if not persistent | ``N·ceil(n/N)·p`` |
| backward | all-gather again, if not persistent | ``N·ceil(n/N)·p`` |
| backward | reduce-scatter, if trained | ``N·ceil(n/N)·g`` |
| after optimizer step | all-gather, if persistent and N > 1 | ``N·ceil(n/N)·p`` |
| end of each forward | trace check (``first`` mode) | ``N·3·8`` (3 int64 per rank) |

So a micro-step moves ``≈ 3Ψ`` elements (``2Ψ_np·p + Ψ·g``, Ψ_np the non-persistent elements),
against stage 1/2's ``2Ψ`` (reduce-scatter + all-gather): stage 3 pays 1.5× the communication for
holding ``1/N`` of the parameters. Padding adds fewer than N elements per parameter. Assumed: every
non-persistent parameter belongs to a module that runs once in forward and whose outputs receive
gradients (so it is fetched once per forward and once per backward; a module run twice is
fetched twice unless ``stage3_max_reuse_distance`` keeps it: Note [reuse distance] in
prefetch.py); the first forward of a run (trace recording: one check per module start, demand
fetches of tied weights) costs more.
With one rank a persistent parameter's shard is its whole (padded) value, so
``refresh_gathered`` copies it locally and no collective is issued (the formula counts 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Stage3StepBytes", "stage3_step_bytes"]


@dataclass(frozen=True)
class Stage3StepBytes:
    """Message bytes of one steady-state micro-step of stage 3, per kind of collective."""

    forward_all_gather: int
    backward_all_gather: int
    reduce_scatter: int
    trace_check: int
    #: Once per optimizer step (``publish_params``), not per micro-step.
    persistent_all_gather: int

    @property
    def per_micro_step(self) -> int:
        """Forward + backward + reduce-scatter + the end-of-forward check."""
        return (
            self.forward_all_gather
            + self.backward_all_gather
            + self.reduce_scatter
            + self.trace_check
        )


def _padded(numel: int, world_size: int) -> int:
    return -(-numel // world_size) * world_size


def stage3_step_bytes(
    numels: Sequence[int],
    world_size: int,
    *,
    persistence_threshold_numel: int,
    param_bytes: int,
    grad_bytes: int,
    without_grad: Sequence[int] = (),
    trace_check: bool = True,
) -> Stage3StepBytes:
    """The table of the module docstring, summed over parameters.

    ``numels``: every unique parameter's element count (a tied parameter once). ``without_grad``:
    positions in ``numels`` of parameters that are not trained (frozen, or in no optimizer
    group): never reduce-scattered. A trained parameter that got no gradient is reduce-scattered
    as zeros (Note [a fixed bucket plan] in strategy.py), so it counts.
    ``trace_check``: the coordinator's default ``first`` mode (one 3-int64 all-gather per forward).
    """
    skip = set(without_grad)
    gather = sum(_padded(n, world_size) for n in numels if n > persistence_threshold_numel)
    persistent = sum(_padded(n, world_size) for n in numels if n <= persistence_threshold_numel)
    reduced = sum(_padded(n, world_size) for i, n in enumerate(numels) if i not in skip)
    return Stage3StepBytes(
        forward_all_gather=gather * param_bytes,
        backward_all_gather=gather * param_bytes,
        reduce_scatter=reduced * grad_bytes,
        trace_check=world_size * 3 * 8 if trace_check and world_size > 1 else 0,
        persistent_all_gather=persistent * param_bytes if world_size > 1 else 0,
    )
