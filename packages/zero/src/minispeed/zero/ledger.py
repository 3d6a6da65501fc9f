"""What ZeRO stages 0-2 send per optimizer step, written once: docs, tests and the estimator call it.

Ψ = parameters, Ψ' = Ψ padded (each bucket rounded up to a multiple of N, at most N-1 elements
per bucket), N = data-parallel ranks, g / p = bytes per gradient / parameter element on the wire
(gradients travel in ``grad_accum_dtype``), A = gradient accumulation steps, m = managed
parameter tensors. Per rank, ring algorithms (``minispeed.comm.costs``):

| stage | collectives per optimizer step | bytes this rank sends |
|---|---|---|
| 0 | all-reduce of every gradient bucket (unpadded) | 2(N-1)/N · Ψ·g |
| 1 | reduce-scatter of every padded bucket, all-gather of the updated parameters | (N-1)/N · Ψ'·g + (N-1)/N · Ψ'·p |
| 2 | as stage 1, but the reduce-scatter runs every micro-step (the full gradient is never kept) | A·(N-1)/N · Ψ'·g + (N-1)/N · Ψ'·p |

plus, every stage, one all-reduce of m + 1 fp32 flags (overflow and unused parameters, see
Note [unused parameters] in optimizer.py): 2(N-1)/N · 4(m+1), and with clipping on a stage that
partitions gradients (1-3) one fp32 all-reduce of the squared norm: 2(N-1)/N · 4. At stage 0
without loss scaling (`ZeroOptimizer.flags_in_bucket`) the m flags travel in the last
gradient bucket's all-reduce instead (Note [the flags ride with the last bucket] in reducer.py):
that bucket's message is m fp32 elements longer (the strategy's ``bucket_numels()`` says so) and
the flags' own call is gone (``flags_in_bucket=True``).

Why "≈ 2Ψ" for all three: an all-reduce *is* a reduce-scatter followed by an all-gather, so
stage 0 sends 2(N-1)/N·Ψ elements as one call and stages 1-2 send the same two halves as two
calls, the all-gather moving updated parameters instead of summed gradients.

With ``reduce_scatter=False`` the stage 1-2 reduction is an all-reduce of each padded bucket:
2(N-1)/N · Ψ'·g instead of (N-1)/N · Ψ'·g. So it is where comm runs a reduce-scatter as an
all-reduce (a backend without one; gloo for ops other than SUM: Note [gloo's reduce-scatter is an
all-reduce] in comm's api_compat); on gloo a SUM runs as comm's ring (``ring_p2p``), at the
reduce-scatter's price. Pass ``reduce_scatter_impl=comm.reduce_scatter_impl(group)`` to price
what the backend sends.

1-bit Adam after its freeze (`onebit.py`) reduces no gradient: the full momentum of the Ψ_t
trainable elements is averaged by one 1-bit all-reduce (an all_to_all and an all_gather of n
messages of 4 + C/8 bytes, C = 8 ceil(Ψ_t / 8N): `comm.compression.wire`), 2(N-1)(4 + C/8)
bytes, and clipping reads each rank's local norm (no all-reduce); stages 1-2 still all-gather
the parameters. `stage_collectives(..., onebit_numel=Ψ_t)` lists that step.

The per-call functions are exact (they add up `wire_bytes` over the
calls the stages issue, including its integer rounding); `approx_wire_bytes_per_step` is
the closed form for documentation and the estimator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minispeed.comm import costs
from minispeed.comm.compression.wire import onebit_allreduce_calls

__all__ = ["Collective", "approx_wire_bytes_per_step", "stage_collectives", "wire_bytes_per_step"]


@dataclass(frozen=True)
class Collective:
    """One collective call as the comms logger records it (op name, message, group size)."""

    op: str  # "all_reduce", "reduce_scatter", "all_gather"; 1-bit Adam: also "all_to_all"
    numel: int  # elements of the message (all_gather: output; reduce_scatter: input)
    element_bytes: int
    world_size: int
    impl: str = "native"  # how comm runs it (`comm.reduce_scatter_impl`); prices the wire

    @property
    def msg_bytes(self) -> int:
        """Message size S, nccl-tests convention."""
        return self.numel * self.element_bytes

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends for this call."""
        return costs.wire_bytes(self.op, self.msg_bytes, self.world_size, impl=self.impl)


def stage_collectives(
    stage: int,
    world_size: int,
    reduce_numels: Sequence[int],
    gather_numels: Sequence[int],
    grad_bytes: int,
    param_bytes: int,
    num_params: int,
    gradient_accumulation_steps: int = 1,
    reduce_scatter: bool = True,
    clip_norm: bool = False,
    reduce_scatter_impl: str = "native",
    onebit_numel: int | None = None,
    flags_in_bucket: bool = False,
) -> list[Collective]:
    """Every collective one optimizer step of ``stage`` issues, in a fixed order.

    ``reduce_numels``: elements of each gradient bucket's reduction (stage 0 unpadded, stages 1-2
    padded; the strategies' ``bucket_numels()``); ``gather_numels``: output elements of each
    parameter all-gather (``PartitionedStrategy.gather_numels()``; ignored for stage 0).
    ``onebit_numel``: a 1-bit Adam step after the freeze, whose momentum vector holds that many
    elements (``reduce_numels`` and ``clip_norm`` then do not apply). ``flags_in_bucket``:
    the optimizer's flags rode in the last bucket (`ZeroOptimizer.flags_in_bucket`; stage 0,
    whose ``reduce_numels`` then count them), so they have no call of their own.
    """
    if flags_in_bucket and (stage != 0 or onebit_numel is not None):
        raise ValueError("flags_in_bucket: only stage 0's gradient all-reduce carries the flags")
    if stage not in (0, 1, 2):
        raise ValueError(
            f"stage_collectives covers stages 0-2 (stage 3's ledger is in stage3/), got {stage}"
        )
    n = world_size
    calls: list[Collective] = []
    if onebit_numel is not None:
        calls.append(Collective("all_reduce", num_params + 1, 4, n))  # overflow + unused flags
        calls += [Collective(op, msg, 1, n) for op, msg in onebit_allreduce_calls(onebit_numel, n)]
        if stage > 0:
            calls += [Collective("all_gather", k, param_bytes, n) for k in gather_numels]
        return calls
    if stage == 0:
        calls += [Collective("all_reduce", k, grad_bytes, n) for k in reduce_numels]
    else:
        op = "reduce_scatter" if reduce_scatter else "all_reduce"
        times = gradient_accumulation_steps if stage == 2 else 1
        calls += [
            Collective(op, k, grad_bytes, n, reduce_scatter_impl)
            for _ in range(times)
            for k in reduce_numels
        ]
    if not flags_in_bucket:
        calls.append(Collective("all_reduce", num_params + 1, 4, n))  # overflow + unused flags
    if clip_norm and stage > 0:
        calls.append(Collective("all_reduce", 1, 4, n))  # squared global norm
    if stage > 0:
        calls += [Collective("all_gather", k, param_bytes, n) for k in gather_numels]
    return calls


def wire_bytes_per_step(calls: Sequence[Collective]) -> int:
    """Total bytes this rank sends for ``calls`` (exact)."""
    return sum(c.wire_bytes for c in calls)


def approx_wire_bytes_per_step(
    stage: int,
    numel: int,
    world_size: int,
    grad_bytes: int,
    param_bytes: int,
    gradient_accumulation_steps: int = 1,
    reduce_scatter_impl: str = "native",
) -> float:
    """Closed form for the dominant terms (no padding, no flags): see the module table. With a
    `reduce_scatter_impl` that is an all-reduce (`all_reduce+slice`, `all_reduce_in_place`), each
    reduce-scatter term doubles.

    Stage 3 (for comparison; stage 3's own module is authoritative): reduce-scatter per
    micro-step plus a parameter all-gather in forward and again in backward:
    A·((N-1)/N · Ψ·g + 2 (N-1)/N · Ψ·p).
    """
    ring = (world_size - 1) / world_size
    a = gradient_accumulation_steps
    rs = 2 if reduce_scatter_impl.startswith("all_reduce") else 1  # reduce-scatter's factor
    if stage == 0:
        return 2 * ring * numel * grad_bytes
    if stage == 1:
        return ring * numel * (rs * grad_bytes + param_bytes)
    if stage == 2:
        return ring * numel * (a * rs * grad_bytes + param_bytes)
    if stage == 3:
        return a * ring * numel * (rs * grad_bytes + 2 * param_bytes)
    raise ValueError(f"stage must be 0-3, got {stage}")
