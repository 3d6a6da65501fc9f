"""A collective returns (or its `wait()` does) only once the backend has let go of its tensors,
so a script that ends right after its last collective exits cleanly (issue 32 §1; Note [the
backend lets go before we do] in handoff.py).

Before, gloo's worker thread dropped an op's tensors after the caller had been woken: about half
of the calls here returned with the backend still holding the caller's tensor, and when that
drop came during interpreter finalization the process aborted (`terminate called without an
active exception`) after a correct run. This test checks the mechanism on every call;
tests/test_stress_exit.py runs the exits themselves.
"""

from __future__ import annotations

import torch

import minispeed.comm as comm
from minispeed.comm import handoff
from minispeed.core.testing import distributed_test


def _held_by_others(t: torch.Tensor) -> bool:
    return t._use_count() != 1  # 1: the caller's own tensor object alone


@distributed_test(world_size=2)
def test_no_collective_returns_while_the_backend_holds_its_tensors(rank, world_size):
    held = []
    for i in range(20):
        for async_op in (False, True):
            t = torch.ones(64)
            work = comm.all_reduce(t, async_op=async_op)
            if work is not None:
                work.wait()
            held.append(("all_reduce", async_op, _held_by_others(t)))
            out, mine = torch.empty(128), torch.ones(64)
            work = comm.all_gather_into_tensor(out, mine, async_op=async_op)
            if work is not None:
                work.wait()
            held.append(("all_gather", async_op, _held_by_others(out) or _held_by_others(mine)))
            t = torch.ones(64)
            work = comm.broadcast(t, 0, async_op=async_op)
            if work is not None:
                work.wait()
            held.append(("broadcast", async_op, _held_by_others(t)))
        assert not handoff._unsettled, i  # a CPU op's loan is settled when it returns
    bad = [(op, a) for op, a, h in held if h]
    assert not bad, f"{len(bad)} of {len(held)} calls returned while gloo held a tensor: {bad[:4]}"


_BACKEND_CALLS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor")
_BACKEND_CALLS += ("reduce_scatter_tensor", "all_to_all_single")


@distributed_test(world_size=2)
def test_every_tensor_handed_to_the_backend_is_lent(rank, world_size):
    """Each tensor a collective hands torch.distributed is an alias the open `Loan` keeps (what
    the settling above relies on), on every path: gloo's all-gather as broadcasts, its
    reduce-scatter as an all-reduce, the fallbacks. A view made on the way and handed over
    bare is one the worker could drop last at exit."""
    import torch.distributed as dist

    from minispeed.comm import call as call_module

    bare = []

    def watch(name, real):
        def call(*args, **kwargs):
            loan = getattr(handoff._local, "open", None)
            lent = {id(a) for a in loan.aliases} if loan is not None else set()
            given = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
            given += [t for x in args if isinstance(x, list) for t in x]
            bare.extend(name for t in given if id(t) not in lent)
            return real(*args, **kwargs)

        return call

    patched = [(dist, name) for name in _BACKEND_CALLS]
    patched += [
        (call_module, "ALL_GATHER_FLAT_NATIVE"),
        (call_module, "REDUCE_SCATTER_FLAT_NATIVE"),
    ]
    saved = [getattr(owner, name) for owner, name in patched]
    for (owner, name), real in zip(patched, saved):
        setattr(owner, name, watch(name, real))
    try:
        for async_op in (False, True):
            works = [
                comm.all_reduce(torch.ones(8), async_op=async_op),
                comm.broadcast(torch.ones(8), 0, async_op=async_op),
                comm.all_gather_into_tensor(torch.empty(16), torch.ones(8), async_op=async_op),
                comm.reduce_scatter_tensor(torch.empty(4), torch.ones(8), async_op=async_op),
                comm.all_to_all_single(torch.empty(8), torch.ones(8), async_op=async_op),
            ]
            for work in works:
                if work is not None:
                    work.wait()
    finally:
        for (owner, name), real in zip(patched, saved):
            setattr(owner, name, real)
    assert not bare, f"handed to the backend without a loan: {sorted(set(bare))}"
