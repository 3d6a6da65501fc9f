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
    """Whether anything but the caller's tensor object holds `t` or its memory: the backend
    holding `t` itself, or a view of it (gloo's all-gather runs as broadcasts of `t`'s chunks)."""
    storage = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    return t._use_count() != 1 or storage != 2  # 2: t's own and this call's storage object


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
