"""Cross-rank checks by default: mismatched calls fail on every rank, and cost nothing logged.

Without validation mode, the first call of each call site compares a fingerprint across the
group (see minispeed.comm.handshake). Before this existed, 10 against 12 elements, or fp32
against int32, made gloo abort one rank and hand the other a wrong result.
"""

import pytest
import torch

import minispeed.comm as comm
from minispeed.comm import handshake
from minispeed.core.testing import run_distributed


def _mismatch_body(rank: int, world_size: int, kind: str) -> str:
    odd = world_size - 1
    with pytest.raises(comm.CommMismatchError) as info:
        if kind == "numel":
            comm.all_reduce(torch.ones(12 if rank == odd else 10))
        elif kind == "dtype":
            comm.all_reduce(torch.ones(10, dtype=torch.int32 if rank == odd else torch.float32))
        elif kind == "reduce_scatter":
            comm.reduce_scatter_tensor(
                torch.empty(6 if rank == odd else 5),
                torch.ones(world_size * (6 if rank == odd else 5)),
            )
        else:  # "op": one rank broadcasts while the others all-reduce
            if rank == odd:
                comm.broadcast(torch.ones(4), src=0)
            else:
                comm.all_reduce(torch.ones(4))
    comm.barrier()  # every rank is still in step
    return str(info.value)


@pytest.mark.parametrize("kind", ["numel", "dtype", "reduce_scatter", "op"])
def test_mismatched_call_raises_on_every_rank_without_validation_mode(kind):
    messages = run_distributed(_mismatch_body, world_size=2, args=(kind,), timeout_s=60)
    assert len(set(messages)) == 1, "every rank must raise the same error"
    assert "ranks [1]" in messages[0]
    if kind == "numel":
        assert "rank 0: all_reduce(dtype=torch.float32 op=" in messages[0]
        assert "shape=(10,)" in messages[0] and "shape=(12,)" in messages[0]
    if kind == "dtype":
        assert "torch.int32" in messages[0] and "torch.float32" in messages[0]


def _count_checks(rank: int, world_size: int) -> dict:
    calls = []
    real_compare = handshake.compare

    def counting(op, *args, **kwargs):
        calls.append(op)
        return real_compare(op, *args, **kwargs)

    handshake.compare = counting
    try:
        counts = {}
        for mode in ("first", "all", "off"):
            calls.clear()
            with comm.validation_mode(mode):
                for _ in range(3):  # one call site, three calls
                    comm.all_reduce(torch.ones(4))
                for _ in range(2):  # a second site
                    comm.all_gather_into_tensor(torch.empty(2 * world_size), torch.ones(2))
            counts[mode] = list(calls)
    finally:
        handshake.compare = real_compare
    return counts


def test_default_checks_the_first_call_of_each_site_and_validation_mode_every_call():
    counts = run_distributed(_count_checks, world_size=2, timeout_s=60)[0]
    # "first" (run first, so the sites are new): one check per (site, group)
    assert counts["first"] == ["all_reduce", "all_gather"]
    assert counts["all"] == ["all_reduce"] * 3 + ["all_gather"] * 2
    assert counts["off"] == []


def _logged_body(rank: int, world_size: int, mode: str) -> list:
    with comm.validation_mode(mode), comm.CommsLogger() as log:
        comm.all_reduce(torch.ones(100))
        comm.all_gather_into_tensor(torch.empty(4 * world_size), torch.ones(4))
        comm.barrier()
    return [(r.op, r.msg_bytes, r.wire_bytes) for r in log.records]


def test_checks_never_appear_in_the_comms_log():
    logs = {
        mode: run_distributed(_logged_body, world_size=2, args=(mode,), timeout_s=60)[0]
        for mode in ("off", "first", "all")
    }
    assert logs["off"] == logs["first"] == logs["all"]
    assert [op for op, _, _ in logs["off"]] == ["all_reduce", "all_gather", "barrier"]


def _rejected_body(rank: int, world_size: int, case: str) -> str:
    with pytest.raises(comm.CommInputError) as info:
        if case == "non_contiguous":
            t = torch.ones(4, 4).t() if rank == 0 else torch.ones(4, 4)
            comm.all_reduce(t)
        else:  # wrong output size on rank 0 only
            out = torch.empty(3 if rank == 0 else 2)
            comm.reduce_scatter_tensor(out, torch.ones(2 * world_size))
    comm.barrier()
    return str(info.value)


@pytest.mark.parametrize("case", ["non_contiguous", "output_size"])
def test_an_error_one_rank_finds_reaches_every_rank(case):
    messages = run_distributed(_rejected_body, world_size=2, args=(case,), timeout_s=60)
    own = "not contiguous" if case == "non_contiguous" else "output has 3 elements"
    assert own in messages[0]
    assert "rank(s) [0] rejected their arguments" in messages[1]
    assert own in messages[1], "the peer quotes rank 0's own error"


def test_unknown_validation_mode_names_the_choices():
    with (
        pytest.raises(comm.CommInputError, match="pass True / 'all', 'first' or False / 'off'"),
        comm.validation_mode("sometimes"),
    ):
        pass


def _bad_env_body(rank: int, world_size: int) -> str:
    with pytest.raises(comm.CommInputError) as info:
        comm.all_reduce(torch.ones(1))
    return str(info.value)


def test_unknown_environment_value_names_the_choices():
    message = run_distributed(
        _bad_env_body, world_size=1, env={"MINISPEED_COMM_VALIDATE": "maybe"}, timeout_s=60
    )[0]
    assert "use 0 (off), first (the default) or 1 (every call)" in message


def _second_site_body(rank: int, world_size: int, which: str) -> str:
    """A matching call at one line, then a mismatched one at another: the second line is a new
    call site (the caller's line, not a line inside the collective), so it is checked too."""
    numel = 16 if rank == world_size - 1 else 8
    if which == "quantized_all_gather":
        qag = comm.compression.quantized_all_gather_into_tensor
        qag(torch.empty(world_size * 8), torch.ones(8))  # first site: every rank agrees
        with pytest.raises(comm.CommMismatchError) as info:
            qag(torch.empty(world_size * numel), torch.ones(numel))  # second site
    else:  # a fresh top-k all-reduce per call: its residual is sized on first use
        comm.compression.TopkAllReduce()(torch.ones(8))
        with pytest.raises(comm.CommMismatchError) as info:
            comm.compression.TopkAllReduce()(torch.ones(numel))
    comm.barrier()
    return str(info.value)


@pytest.mark.parametrize("which", ["quantized_all_gather", "topk"])
def test_compressed_collectives_check_each_call_site_of_their_caller(which):
    messages = run_distributed(_second_site_body, world_size=2, args=(which,), timeout_s=60)
    assert len(set(messages)) == 1 and "ranks [1]" in messages[0]
