"""Bad input raises a clear error on the calling rank, before any rank blocks.

Local checks are tested with ONLY the bad rank calling and cross-rank checks off (as for a call
site's later calls): had the check been missing, that rank would block in the backend waiting
for a peer that never comes, and the test would time out. Cross-rank mismatches are caught by
validation mode on every rank; a missing peer ends in a CommTimeoutError naming the op.
test_handshake_mismatch.py covers the default checks and errors that reach every rank.
"""

import re
from contextlib import nullcontext

import pytest
import torch

import minispeed.comm as comm
from minispeed.comm import handshake
from minispeed.core.testing import run_distributed

# (description, call, expected message fragment). Each is called by rank 0 alone.
_LOCAL_CASES = {
    "wrong_device": (
        lambda n: comm.all_reduce(torch.ones(2, device="meta")),
        "is on meta",
    ),
    "reduce_scatter_not_divisible": (
        lambda n: comm.reduce_scatter_tensor(torch.empty(1), torch.ones(2 * n + 1)),
        "do not split evenly",
    ),
    "reduce_scatter_output_size": (
        lambda n: comm.reduce_scatter_tensor(torch.empty(3), torch.ones(2 * n)),
        "output has 3 elements, expected 2",
    ),
    "all_gather_output_size": (
        lambda n: comm.all_gather_into_tensor(torch.empty(n * 2 + 1), torch.ones(2)),
        f"expected {2 * 2}",
    ),
    "dtype_mismatch": (
        lambda n: comm.all_gather_into_tensor(
            torch.empty(2 * n, dtype=torch.float64), torch.ones(2)
        ),
        "output dtype torch.float64 differs from input dtype torch.float32",
    ),
    "non_contiguous": (
        lambda n: comm.all_reduce(torch.ones(4, 4).t()),
        "not contiguous",
    ),
    "all_to_all_split_count": (
        lambda n: comm.all_to_all_single(torch.empty(3), torch.ones(3), [3], [3]),
        "must hold 2 non-negative sizes",
    ),
    "all_to_all_split_sum": (
        lambda n: comm.all_to_all_single(torch.empty(3), torch.ones(3), [1, 2], [2, 2]),
        "sums to 4",
    ),
    "all_to_all_not_divisible": (
        lambda n: comm.all_to_all_single(torch.empty(3), torch.ones(3)),
        "not divisible by 2 ranks",
    ),
    "broadcast_src_outside_group": (
        lambda n: comm.broadcast(torch.ones(1), src=n + 3),
        "not a global rank of the group",
    ),
    "send_to_self": (
        lambda n: comm.send(torch.ones(1), dst=0),
        "cannot message itself",
    ),
    "sparse": (
        lambda n: comm.all_reduce(torch.ones(4).to_sparse()),
        "is sparse (torch.sparse_coo); collectives move dense tensors: pass t.to_dense()",
    ),
    "coalesced_sparse": (
        lambda n: comm.all_gather_coalesced([torch.empty(n)], [torch.ones(1).to_sparse()]),
        "is sparse (torch.sparse_coo)",
    ),
    "coalesced_mixed_dtypes": (
        lambda n: comm.all_gather_coalesced(
            [torch.empty(n), torch.empty(n, dtype=torch.int64)],
            [torch.ones(1), torch.ones(1, dtype=torch.int64)],
        ),
        "one dtype per call",
    ),
}


def _local_body(rank: int, world_size: int, case: str) -> str:
    call, _ = _LOCAL_CASES[case]
    message = ""
    if rank == 0:
        with comm.validation_mode(False), pytest.raises(comm.CommInputError) as info:
            call(world_size)
        message = str(info.value)
    comm.barrier()  # both ranks still talk: nobody was left blocked
    return message


@pytest.mark.parametrize("case", sorted(_LOCAL_CASES))
def test_local_check_raises_before_blocking(case):
    message = run_distributed(_local_body, world_size=2, args=(case,), timeout_s=120)[0]
    assert _LOCAL_CASES[case][1] in message


def _non_member_body(rank: int, world_size: int) -> str:
    only_zero = comm.new_group([0])
    message = ""
    if rank == 1:  # torch would skip this call silently; we refuse
        with pytest.raises(comm.CommInputError) as info:
            comm.all_reduce(torch.ones(2), group=only_zero)
        message = str(info.value)
    comm.barrier()
    return message


def test_group_the_rank_is_not_in():
    message = run_distributed(_non_member_body, world_size=2)[1]
    assert "global rank 1 is not a member of this group" in message


def _non_member_compressed_body(rank: int, world_size: int) -> dict:
    from minispeed.comm.compression import (
        OnebitAllReduce,
        TopkAllReduce,
        quantized_all_gather_into_tensor,
        quantized_reduce_scatter_tensor,
    )

    only_zero = comm.new_group([0])
    calls = {
        "onebit": lambda: OnebitAllReduce(group=only_zero)(torch.ones(16)),
        "topk": lambda: TopkAllReduce(group=only_zero)(torch.ones(16)),
        "quantized_all_gather": lambda: quantized_all_gather_into_tensor(
            torch.empty(8), torch.ones(8), group=only_zero
        ),
        "quantized_reduce_scatter": lambda: quantized_reduce_scatter_tensor(
            torch.empty(8), torch.ones(8), group=only_zero
        ),
    }
    messages = {}
    if rank == 1:  # these used to fail with "negative dimension -8" or "-1 ranks"
        for name, call in calls.items():
            with pytest.raises(comm.CommInputError) as info:
                call()
            messages[name] = str(info.value)
    comm.barrier()
    return messages


def test_compressed_collectives_check_membership_like_the_dense_ones():
    messages = run_distributed(_non_member_compressed_body, world_size=2)[1]
    assert len(messages) == 4
    for name, text in messages.items():
        assert "global rank 1 is not a member of this group" in text, name
        assert "comm.is_member(group)" in text, name


def _zero_dim_body(rank: int, world_size: int) -> dict:
    n = world_size
    out = torch.empty(())  # 0-dim: one element per rank; gloo segfaulted on this
    comm.reduce_scatter_tensor(out, torch.arange(n, dtype=torch.float32) + rank)
    gathered = torch.empty(n, 1)  # 2-D output of a 0-dim input
    comm.all_gather_into_tensor(gathered, torch.tensor(float(rank)))
    scalar = torch.tensor(float(rank + 1))
    comm.all_reduce(scalar)
    work = comm.reduce_scatter_tensor(
        torch.empty(1, 2), torch.ones(n, 2) * (rank + 1), async_op=True
    )
    work.wait()
    return {"rs": out.item(), "ag": gathered.view(-1).tolist(), "ar": scalar.item()}


def test_zero_dim_and_multi_dim_buffers_reach_the_backend_flat():
    results = run_distributed(_zero_dim_body, world_size=2, timeout_s=60)
    for rank, res in enumerate(results):
        assert res["rs"] == 2 * rank + 1  # sum over ranks r of (rank + r)
        assert res["ag"] == [0.0, 1.0]
        assert res["ar"] == 3.0


def _mismatch_body(rank: int, world_size: int, kind: str) -> str:
    odd = world_size - 2  # the rank that calls differently
    with comm.validation_mode(), pytest.raises(comm.CommMismatchError) as info:
        if kind == "shape":
            comm.all_reduce(torch.ones(3 if rank == odd else 4))
        elif kind == "dtype":
            comm.all_reduce(torch.ones(4, dtype=torch.float64 if rank == odd else torch.float32))
        elif kind == "op":
            if rank == odd:
                comm.broadcast(torch.ones(4), src=0)
            else:
                comm.all_reduce(torch.ones(4))
        else:  # all_to_all splits that do not mirror each other
            n = world_size
            comm.all_to_all_single(torch.empty(n), torch.ones(n), [1] * n, [1] * n)
            bad = [2] + [1] * (n - 2) + [0] if rank == odd else [1] * n
            comm.all_to_all_single(torch.empty(n), torch.ones(n), [1] * n, bad)
    comm.barrier()
    return str(info.value)


@pytest.mark.parametrize(
    ("kind", "world_size"),
    [("shape", 2), ("shape", 4), ("dtype", 2), ("op", 2), ("splits", 2), ("splits", 4)],
)
def test_validation_mode_names_op_and_ranks(kind, world_size):
    messages = run_distributed(_mismatch_body, world_size=world_size, args=(kind,))
    odd = world_size - 2
    assert len(set(messages)) == 1, "every rank must raise the same error"
    text = messages[0]
    if kind == "op":  # 2 ranks: rank 0 (broadcast) is the reference
        assert text.startswith("broadcast: ranks [1] called other collectives")
        assert "rank 1: all_reduce(" in text and "rank 0: broadcast(" in text
        return
    assert text.startswith("all_reduce" if kind != "splits" else "all_to_all")
    if kind == "splits":
        assert re.search(r"disagree between ranks \[.*\b" + str(odd) + r"\b", text)
    elif world_size == 4:
        assert f"ranks [{odd}] called with arguments that differ from rank 0" in text
    else:  # 2 ranks: a tie; the lowest rank is the reference
        assert "ranks [1] called with arguments that differ from rank 0" in text


def _env_validation_body(rank: int, world_size: int) -> str:
    with pytest.raises(comm.CommMismatchError) as info:
        comm.all_gather_into_tensor(torch.empty(world_size * (rank + 1)), torch.ones(rank + 1))
    return str(info.value)


def test_validation_from_environment_variable():
    messages = run_distributed(
        _env_validation_body, world_size=2, env={"MINISPEED_COMM_VALIDATE": "1"}
    )
    assert "all_gather: ranks [1]" in messages[0]


def _timeout_body(rank: int, world_size: int, op: str) -> list[str]:
    messages = []
    for async_op in (False, True):
        group = comm.new_group([0, 1], timeout_s=1.5)
        if rank == 0:  # rank 1 never joins this collective
            buf = torch.ones(5, 2) if op == "all_reduce" else torch.ones(2 * 3)
            # reduce_scatter: no cross-rank check, so the messages of comm's ring over p2p (gloo)
            # are what times out
            mode = nullcontext() if op == "all_reduce" else handshake.validation_mode("off")
            with mode, pytest.raises(comm.CommTimeoutError) as info:
                if op == "all_reduce":
                    work = comm.all_reduce(buf, group=group, async_op=async_op)
                else:
                    work = comm.reduce_scatter_tensor(buf[:3], buf, group=group, async_op=async_op)
                if work is not None:
                    work.wait()
            messages.append(str(info.value))
        comm.barrier()  # the world group is still healthy
    return messages


@pytest.mark.parametrize(
    "op, shapes", [("all_reduce", "[(5, 2)]"), ("reduce_scatter", "[(3,), (6,)]")]
)
def test_timeout_names_op_shapes_and_group(op, shapes):
    messages = run_distributed(_timeout_body, world_size=2, args=(op,), timeout_s=120)[0]
    assert len(messages) == 2
    for text in messages:
        assert text.startswith(f"{op} on rank 0 over group ranks [0, 1] (shapes {shapes}"), text
        assert "MINISPEED_COMM_VALIDATE=1" in text


def _coalesced_timeout_body(rank: int, world_size: int) -> str:
    group = comm.new_group([0, 1], timeout_s=1.5)
    message = ""
    if rank == 0:  # rank 1 never joins
        with pytest.raises(comm.CommTimeoutError) as info:
            outs = [torch.empty(2 * 3), torch.empty(2 * 4)]
            comm.all_gather_coalesced(outs, [torch.ones(3), torch.ones(2, 2)], group=group)
        message = str(info.value)
    comm.barrier()
    return message


def test_coalesced_timeout_names_the_input_shapes():
    message = run_distributed(_coalesced_timeout_body, world_size=2, timeout_s=120)[0]
    assert message.startswith(
        "all_gather_coalesced on rank 0 over group ranks [0, 1] (shapes [(3,), (2, 2)]"
    ), message


def test_not_initialized_names_the_fix():
    with pytest.raises(comm.CommInputError, match=r"call comm\.init_distributed"):
        comm.all_reduce(torch.ones(1))
