"""The limit of a ZeRO stage on this machine: the compute floor plus the stage's own collectives.

On 2 CPU cores a collective's reductions and copies run on the same cores as forward and
backward, so overlapping communication with compute hides latency, not work: the least a stage
can take is the floor (forward, backward, AdamW over this rank's 1/N of every parameter;
`contenders.FLOOR`) plus its collectives run alone. `limit_trainer` builds the rest as a
contender of its own (`ZeRO-k limit - floor`): every call one optimizer step of stage k issues,
at the sizes and on the group the ledger says, straight to torch.distributed, synchronously and
back to back; for stage 0, which steps every parameter on every rank, also AdamW over the other
(N-1)/N of each parameter, so that floor + it computes what the stage computes. The report adds
its time to the floor's, round by round: that sum is the stage's limit.

Where the list comes from: stage k is built over the benchmark's model and config, stepped twice
(stage 3 records its fetch order in the first step), and its third step is logged by the comms
logger. Stages 0-2: the logged calls must equal `zero.ledger.stage_collectives` for the strategy's
buckets, call for call. Stage 3 (whose ledger states bytes per kind, not calls): each kind's bytes
must equal `zero.stage3.stage3_step_bytes`. The list replayed is the ledger's (stages 0-2) or the
logged one so checked (stage 3). A coalesced all-gather is replayed as one flat all-gather of its
total size: the same bytes in one call, without the packing copies, which are the stage's own
overhead, not communication.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Contender names: `limit_name(k)` for k in 0..3.
LIMITS = [f"ZeRO-{k} limit - floor" for k in range(4)]


def limit_name(stage: int) -> str:
    """The contender that runs what stage `stage`'s limit adds to the floor."""
    return LIMITS[stage]


@dataclass(frozen=True)
class Call:
    """One collective of a step: op, message elements (all-gather: output; reduce-scatter: input)
    and element type."""

    op: str  # "all_reduce", "reduce_scatter" or "all_gather"
    numel: int
    dtype: torch.dtype
    impl: str = "native"  # how the backend runs it: `minispeed.comm.reduce_scatter_impl`


_DTYPES = {"torch.float32": torch.float32, "torch.int64": torch.int64}
_GATHERS = ("all_gather", "all_gather_coalesced")


def step_calls(
    stage: int, build_zero: Callable, batches: list, world: int
) -> tuple[list[Call], list[int]]:
    """The collectives of one steady optimizer step of stage `stage`, checked against the ledger,
    and the model's parameter sizes.

    `build_zero()` returns (model, zero optimizer, config); `batches`: three (x, y) pairs.
    """
    import minispeed.comm as comm
    from minispeed.zero import ledger
    from minispeed.zero.stage3 import stage3_step_bytes

    model, zopt, cfg = build_zero()
    for x, y in batches[:2]:
        zopt.backward(model(x, y)[1])
        zopt.step()
    with comm.CommsLogger() as log:
        x, y = batches[2]
        zopt.backward(model(x, y)[1])
        zopt.step()
    records = log.records
    if any(r.group_size != world for r in records):
        raise SystemExit(f"ZeRO-{stage} issued a collective on a sub-group; the limit assumes one")
    numels = [p.numel() for p in model.parameters()]
    num_params = len(numels)
    if stage < 3:
        strategy = zopt.strategy
        want = ledger.stage_collectives(
            stage,
            world,
            strategy.bucket_numels(),
            strategy.gather_numels() if stage else [],
            grad_bytes=4,
            param_bytes=4,
            num_params=num_params,
            reduce_scatter=cfg.reduce_scatter,
            clip_norm=cfg.max_grad_norm > 0,
            reduce_scatter_impl=comm.reduce_scatter_impl(),
            flags_in_bucket=zopt.flags_in_bucket,
        )
        got = sorted((r.op, r.numel, r.msg_bytes) for r in records)
        if got != sorted((c.op, c.numel, c.msg_bytes) for c in want):
            raise SystemExit(f"ZeRO-{stage}'s logged collectives differ from zero.ledger's list")
        return [Call(c.op, c.numel, torch.float32, c.impl) for c in want], numels
    # Stage 3: bytes per kind against the stage-3 ledger.
    want3 = stage3_step_bytes(
        numels,
        world,
        persistence_threshold_numel=cfg.stage3_param_persistence_threshold_numel,
        param_bytes=4,
        grad_bytes=4,
    )

    def total(ops: tuple[str, ...], dtype: str) -> int:
        return sum(r.msg_bytes for r in records if r.op in ops and r.dtype == dtype)

    f32 = "torch.float32"
    flags = [r for r in records if r.op == "all_reduce"]
    checks = {
        "all-gathers": (
            total(_GATHERS, f32),
            want3.forward_all_gather + want3.backward_all_gather + want3.persistent_all_gather,
        ),
        "reduce-scatters": (total(("reduce_scatter",), f32), want3.reduce_scatter),
        "trace check": (total(_GATHERS, "torch.int64"), want3.trace_check),
        "flags": ([r.numel for r in flags], [num_params + 1]),
    }
    for kind, (got3, expected) in checks.items():
        if got3 != expected:
            raise SystemExit(f"ZeRO-3's {kind} ({got3}) differ from the ledger's ({expected})")
    calls = [
        Call("all_gather" if r.op in _GATHERS else r.op, r.numel, _DTYPES[r.dtype], r.impl)
        for r in records
    ]
    # An async call is logged when it is waited for, which may differ between ranks (a finished
    # reduce-scatter is reaped early on one, late on another): every rank replays rank 0's order
    # of the same calls.
    import torch.distributed as dist

    lists = [None] * world
    dist.all_gather_object(lists, calls)
    if any(sorted(map(repr, other)) != sorted(map(repr, calls)) for other in lists):
        raise SystemExit("ZeRO-3's ranks logged different collectives in one step")
    return lists[0], numels


def replay(calls: list[Call], group=None) -> Callable[[], None]:
    """A function issuing `calls` straight to torch.distributed, synchronously, in order, in
    place, on buffers allocated once (one per element type, the largest message's size).

    Not through minispeed.comm: its per-call checks and records are minispeed's overhead, which
    the limit must not contain. A reduce-scatter runs as the backend runs it for the stage
    (`impl`; on gloo comm's ring over point-to-point, Note [ring reduce-scatter over p2p] in
    comm's ring.py, or with `--reduce-scatter all_reduce` an in-place all-reduce), an all-gather
    as comm runs it (on gloo one broadcast per rank)."""
    import torch.distributed as dist

    from minispeed.comm.api_compat import all_gather_impl
    from minispeed.comm.call import ALL_GATHER_FLAT_NATIVE, REDUCE_SCATTER_FLAT_NATIVE
    from minispeed.comm.handoff import Loan
    from minispeed.comm.ring import reduce_scatter_ring
    from minispeed.comm.validation import group_ranks

    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    ranks = group_ranks(group)
    buffers = {}
    for c in calls:
        size = -(-c.numel // n) * n
        if buffers.get(c.dtype, torch.empty(0)).numel() < size:
            buffers[c.dtype] = torch.zeros(size, dtype=c.dtype)

    def run() -> None:
        # an all-gather runs as comm runs it here (Note [gloo's all-gather is broadcasts])
        gather_by_broadcasts = all_gather_impl(group) == "broadcasts"
        for c in calls:
            whole = buffers[c.dtype][: c.numel]
            m = c.numel // n
            mine = whole[me * m : (me + 1) * m]  # in place, as the stages run them
            if c.op == "all_reduce" or c.impl.startswith("all_reduce"):
                dist.all_reduce(whole, group=group)
            elif c.impl == "ring_p2p":  # comm's ring, without comm's per-call checks and records
                with Loan() as loan:
                    reduce_scatter_ring(mine, whole, group, False)
                loan.settle()
            elif c.op == "reduce_scatter":
                REDUCE_SCATTER_FLAT_NATIVE(mine, whole, group=group)
            elif gather_by_broadcasts:
                works = [
                    dist.broadcast(chunk, src, group=group, async_op=True)
                    for chunk, src in zip(whole.view(n, m), ranks)
                ]
                for work in works:
                    work.wait()
            else:
                ALL_GATHER_FLAT_NATIVE(whole, mine, group=group)

    return run


def limit_trainer(stage: int, args: argparse.Namespace, build_zero: Callable, vocab: int):
    """The `ZeRO-k limit - floor` contender: forward and backward do nothing, the optimizer step
    issues the step's collectives (`step_calls`), then, for stage 0, AdamW over the (N-1)/N of
    each parameter the floor leaves out (stand-in gradients, as the floor's). Its loss is 0 (it
    trains nothing)."""
    import torch.distributed as dist

    from zerobench.contenders import Trainer, _adamw, stepped_leaves

    g = torch.Generator().manual_seed(args.seed + dist.get_rank())
    batches = [
        (
            torch.randint(vocab, (args.micro_batch, args.block_size), generator=g),
            torch.randint(vocab, (args.micro_batch, args.block_size), generator=g),
        )
        for _ in range(3)
    ]
    world = dist.get_world_size()
    calls, numels = step_calls(stage, build_zero, batches, world)
    communicate = replay(calls)
    step = communicate
    rest = []
    if stage == 0:  # the floor steps ceil(numel / N) of each parameter; stage 0 all of it
        rest = stepped_leaves([n - -(-n // world) for n in numels])
        replicated = _adamw(rest)

        def step() -> None:
            communicate()
            replicated.step()

    zero = torch.zeros(())
    return Trainer(limit_name(stage), lambda x, y: zero, lambda loss: None, step, (calls, rest))
