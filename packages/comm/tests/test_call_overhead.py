"""What one small collective costs in Python, counted (issue 34 point 5: small models pay no
framework tax; timing on a shared machine moves by tens of percent, counts do not).

A group's facts (size, rank, global ranks, backend) are learned on its first call (Note [a
group's facts, once] in validation.py): after that a collective asks torch.distributed nothing
about its group, where it used to ask `is_initialized` and `get_world_size` (six Python calls)
on every call, and `get_backend`, `get_rank` and `get_process_group_ranks` for gloo's all-gather
as broadcasts and a broadcast's ledger. And the wait for gloo's worker to let go of a call's
tensors yields the processor before it sleeps (Note [waiting for the worker: yield, not sleep]
in handoff.py), which is what made a small collective on 2 loaded gloo ranks cost 3-4x the
CPU of torch's own call.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

import minispeed.comm as comm
from minispeed.comm import handoff
from minispeed.core.testing import distributed_test

_QUERIES = ("is_initialized", "get_world_size", "get_rank", "get_backend")
_QUERIES += ("get_process_group_ranks", "get_global_rank", "get_group_rank")

# Python calls (`sys.setprofile` `call` events) in minispeed's own code for one synchronous
# `comm.all_reduce` on a known group, logger off, the call site checked before, not counting the
# wait for gloo's worker (which loops only when the worker was preempted): the collective, `Call`
# (its group facts, the call-site lookup and its mode, the context manager, the tensor check,
# `agree`, `launch`, `complete`), the loan (made, entered, `lend`, left, settled), the named range
# (`minispeed.core.ranges`: 5 with nothing listening) and the issuing lambda: 23 now, 29 before
# the group's facts were kept (torch.distributed's own calls not counted: 15 now, 29 before).
ALL_REDUCE_BUDGET = 24


def _collectives(group, async_op: bool) -> None:
    """One call of each collective whose path asks nothing of torch.distributed once its group
    is known (reduce-scatter's implementation choice, in api_compat, still does)."""
    x, out = torch.ones(8), torch.empty(16)
    pieces, outs = [torch.ones(3), torch.ones(5)], [torch.empty(6), torch.empty(10)]
    for work in (
        comm.all_reduce(x, group=group, async_op=async_op),
        comm.all_gather_into_tensor(out, x, group=group, async_op=async_op),
        comm.broadcast(x, 0, group=group, async_op=async_op),
        comm.all_gather_coalesced(outs, pieces, group=group, async_op=async_op),
    ):
        if work is not None:
            work.wait()


@distributed_test(world_size=2)
def test_a_known_group_costs_no_torch_distributed_query(rank, world_size):
    import torch.distributed as dist

    sub = comm.new_group([0, 1])
    asked: list[str] = []
    real = {name: getattr(dist, name) for name in _QUERIES}

    def counting(name):
        def query(*args, **kwargs):
            asked.append(name)
            return real[name](*args, **kwargs)

        return query

    with comm.CommsLogger() as log:  # the ledger's ranks and wire bytes come from the facts too
        for patched in (False, True):  # the first pass: every call site's first (checked) call
            if patched:
                for name in _QUERIES:
                    setattr(dist, name, counting(name))
            try:
                for group in (None, sub):
                    for async_op in (False, True):
                        _collectives(group, async_op)
            finally:
                for name in _QUERIES:
                    setattr(dist, name, real[name])
    assert not asked, f"a collective on a known group asked torch.distributed: {sorted(set(asked))}"
    broadcasts = [r for r in log.records if r.op == "broadcast"]
    assert {r.wire_bytes for r in broadcasts} == {32 if rank == 0 else 0}  # the root sends S
    assert {r.ranks for r in log.records} == {(0, 1)}


@distributed_test(world_size=2)
def test_a_small_all_reduce_stays_within_its_python_budget(rank, world_size):
    x = torch.ones(8)

    def call() -> None:
        comm.all_reduce(x)  # one call site: checked on its first call only

    for _ in range(3):
        call()
    ours, inside, names = 0, 0, []
    # what varies with thread timing: the wait for a worker that has not let go yet, and the
    # sweep of loans an earlier failed call left unsettled in this (reused) worker process
    varying = {handoff.Loan._wait.__code__, handoff._sweep.__code__}

    def profile(frame, event, arg) -> None:
        nonlocal ours, inside
        if frame.f_code in varying and event in ("call", "return"):
            inside += 1 if event == "call" else -1
        elif (
            event == "call"
            and not inside
            and frame.f_globals.get("__name__", "").startswith("minispeed.")
        ):
            ours += 1
            names.append(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    assert ours <= ALL_REDUCE_BUDGET, (
        f"{ours} Python calls in minispeed for one all_reduce: {names}"
    )
    assert torch.equal(x, torch.full((8,), 2.0**4))


def test_the_wait_for_the_backend_yields_before_it_sleeps(monkeypatch):
    """A loan whose alias something else still holds (here an autograd graph, dropped by a
    thread after a millisecond: gloo's worker, preempted) is waited for by yielding the processor; sleeping
    starts only after `YIELD_S`. The wait used to sleep from the start."""
    t = torch.ones(4)
    loan = handoff.Loan()
    with loan:
        alias = handoff.lend(t)
    alias.requires_grad_()
    holder = [alias * alias]  # the graph holds C++ references to the alias, as gloo's work does
    del alias
    assert not loan.returned()
    sleeps: list[float] = []
    real_sleep = time.sleep
    start = time.monotonic()

    def sleep(s: float) -> None:
        sleeps.append(time.monotonic() - start)
        real_sleep(s)

    monkeypatch.setattr(handoff.time, "sleep", sleep)
    release = threading.Timer(1e-3, holder.clear)
    release.start()
    try:
        loan.settle()
    finally:
        release.join()
    assert loan.aliases == [] and not handoff._unsettled
    assert all(at >= handoff.YIELD_S for at in sleeps), sleeps
