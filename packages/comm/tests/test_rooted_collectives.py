"""`comm.reduce`, `comm.gather`, `comm.scatter`: torch.distributed's values, the ledger's bytes as
costs.py's table writes them by hand, and a wrong root list refused on every rank."""

from __future__ import annotations

import pytest
import torch

import minispeed.comm as comm
from minispeed.core.testing import run_distributed


def _rooted(rank: int, world_size: int) -> dict:
    n, root = world_size, world_size - 1  # a root that is not rank 0
    mine = torch.arange(3.0) + 10 * rank
    with comm.CommsLogger() as log:
        summed = mine.clone()
        comm.reduce(summed, dst=root)
        gathered = [torch.empty(3) for _ in range(n)] if rank == root else None
        comm.gather(mine, gathered, dst=root)
        pieces = [torch.full((3,), float(j)) for j in range(n)] if rank == root else None
        got = torch.empty(3)
        work = comm.scatter(got, pieces, src=root, async_op=True)
        work.wait()
    return {
        "summed": summed.tolist() if rank == root else None,
        "gathered": [g.tolist() for g in gathered] if gathered else None,
        "got": got.tolist(),
        "records": [(r.op, r.msg_bytes, r.wire_bytes, r.group_size) for r in log.records],
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_rooted_collectives_give_torch_values_and_log_their_bytes(world_size):
    n, root = world_size, world_size - 1
    for rank, res in enumerate(run_distributed(_rooted, world_size=n)):
        rows = [torch.arange(3.0) + 10 * r for r in range(n)]
        if rank == root:
            assert res["summed"] == sum(rows).tolist()
            assert res["gathered"] == [r.tolist() for r in rows]
        assert res["got"] == [float(rank)] * 3
        is_root = rank == root
        assert res["records"] == [
            ("reduce", 12, 0 if is_root else 12, n),  # a chain: every non-root sends S
            ("gather", 12 * n, 0 if is_root else 12, n),  # S/n from each non-root
            ("scatter", 12 * n, 12 * (n - 1) if is_root else 0, n),  # (n-1)/n · S from the root
        ]


def _short_list(rank: int, world_size: int) -> str:
    with pytest.raises(comm.CommInputError) as err:
        comm.gather(torch.ones(2), [torch.empty(2)] if rank == 0 else None, dst=0)
    return str(err.value)


def test_a_root_list_of_the_wrong_length_fails_on_every_rank():
    messages = run_distributed(_short_list, world_size=2)
    assert (
        "needs gather_list with one tensor per rank of the group (2), got 1 tensors" in messages[0]
    )
    assert messages[1]  # the peer learns of it instead of waiting
