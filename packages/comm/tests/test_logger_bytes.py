"""The comms logger's ledger is exact: bytes per op follow the formulas written out by hand here."""

import json

import pytest
import torch

import minispeed.comm as comm
from minispeed.comm import costs
from minispeed.core.testing import run_distributed


def _known_sequence(rank: int, world_size: int) -> dict:
    n = world_size
    with comm.CommsLogger() as log:
        comm.all_reduce(torch.ones(100))  # fp32: S = 400
        comm.all_reduce(torch.ones(10, dtype=torch.bfloat16))  # S = 20
        comm.reduce_scatter_tensor(torch.empty(8), torch.ones(8 * n))  # S = input = 32n
        comm.all_gather_into_tensor(
            torch.empty(6 * n, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
        )  # S = 48n
        log.mark_step()
        comm.broadcast(torch.ones(25), src=0)  # S = 100, root sends it
        comm.all_to_all_single(torch.empty(4 * n), torch.ones(4 * n))  # S = 16n
        work = comm.all_reduce(torch.ones(50), async_op=True)  # S = 200, timed at wait()
        assert log.count("all_reduce") == 2, "async op is recorded at wait(), not at issue"
        work.wait()
        work.wait()  # waiting twice records once
        comm.barrier()
    with comm.CommsLogger() as off_check:
        pass
    comm.all_reduce(torch.ones(7))  # logger off: recorded nowhere
    return {
        "records": [
            (r.op, r.msg_bytes, r.wire_bytes, r.group_size, r.step, r.async_op) for r in log.records
        ],
        "total_msg": log.total_msg_bytes(),
        "total_wire": log.total_wire_bytes(),
        "step0_msg": log.total_msg_bytes(step=0),
        "step1_count": log.count(step=1),
        "latencies_positive": all(r.latency_s > 0 for r in log.records if r.op != "barrier"),
        "bw": [
            (r.algbw, r.busbw, r.msg_bytes / r.latency_s) for r in log.records if r.latency_s > 0
        ],
        "off_records": len(off_check.records),
        "active_after": comm.comms_logger() is None,
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_logged_bytes_of_a_known_sequence(world_size):
    n = world_size
    results = run_distributed(_known_sequence, world_size=n)
    for rank, res in enumerate(results):
        # (op, msg_bytes, wire_bytes, group_size, step, async), written out by hand from costs.py's table
        expected = [
            ("all_reduce", 400, 2 * (n - 1) * 400 // n, n, 0, False),
            ("all_reduce", 20, 2 * (n - 1) * 20 // n, n, 0, False),
            # on gloo comm runs it as its own ring over p2p, which sends a ring's (n-1)/n · S
            # (Note [ring reduce-scatter over p2p]), not gloo's all-reduce's twice that
            ("reduce_scatter", 32 * n, (n - 1) * 32, n, 0, False),
            ("all_gather", 48 * n, (n - 1) * 48, n, 0, False),
            ("broadcast", 100, 100 if rank == 0 else 0, n, 1, False),
            ("all_to_all", 16 * n, (n - 1) * 16, n, 1, False),
            ("all_reduce", 200, 2 * (n - 1) * 200 // n, n, 1, True),
            ("barrier", 0, 0, n, 1, False),
        ]
        assert res["records"] == expected
        assert res["total_msg"] == 400 + 20 + 32 * n + 48 * n + 100 + 16 * n + 200
        assert res["total_wire"] == sum(e[2] for e in expected)
        assert res["step0_msg"] == 420 + 80 * n
        assert res["step1_count"] == 4
        assert res["latencies_positive"]
        for algbw, _busbw, msg_over_latency in res["bw"]:
            assert algbw == pytest.approx(msg_over_latency)
        assert res["off_records"] == 0 and res["active_after"]


def test_bus_bandwidth_factors():
    for n in (1, 2, 4, 8):
        assert costs.bus_bandwidth_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
        for op in ("all_gather", "all_gather_coalesced", "reduce_scatter", "all_to_all"):
            assert costs.bus_bandwidth_factor(op, n) == pytest.approx((n - 1) / n)
        for op in ("broadcast", "send", "recv"):
            assert costs.bus_bandwidth_factor(op, n) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        costs.bus_bandwidth_factor("allreduce", 2)


def test_records_derive_algbw_and_busbw_from_latency():
    log = comm.CommsLogger()
    rec = log.add("all_reduce", 1000, "torch.float32", 4000, 4, 2e-3, 6000)
    assert rec.algbw == pytest.approx(4000 / 2e-3)
    assert rec.busbw == pytest.approx(4000 / 2e-3 * 2 * 3 / 4)
    rec = log.add("all_gather", 10, "torch.float32", 40, 4, 1e-3, 30)
    assert rec.busbw == pytest.approx(40 / 1e-3 * 3 / 4)


def test_json_dump_is_complete_and_atomic(tmp_path):
    log = comm.CommsLogger()
    log.add("all_reduce", 4, "torch.float32", 16, 2, 1e-4, 16)
    log.mark_step()
    log.add("send", 2, "torch.float32", 8, 2, 1e-4, 8)
    path = tmp_path / "comms.json"
    path.write_text("old")
    log.to_json(path)
    data = json.loads(path.read_text())
    assert data["total_msg_bytes"] == 24 and data["total_wire_bytes"] == 24 and data["steps"] == 2
    assert [r["op"] for r in data["records"]] == ["all_reduce", "send"]
    assert [r["step"] for r in data["records"]] == [0, 1]
    assert list(tmp_path.iterdir()) == [path], "no temporary file may be left behind"
    table = log.summary(print_table=False)
    assert table.row_count == 2


def test_logger_contexts_nest_and_restore():
    outer, inner = comm.CommsLogger(), comm.CommsLogger()
    assert comm.comms_logger() is None
    with outer:
        with inner:
            assert comm.comms_logger() is inner
        assert comm.comms_logger() is outer
    assert comm.comms_logger() is None


def _async_step_body(rank: int, world_size: int) -> list:
    with comm.CommsLogger() as log:
        work = comm.all_reduce(torch.ones(8), async_op=True)  # issued in step 0
        log.mark_step()
        comm.all_reduce(torch.ones(4))  # step 1
        work.wait()  # waited on in step 1, but it belongs to step 0
    return [(r.numel, r.step, r.async_op) for r in log.records]


def test_async_call_carries_the_step_of_issue():
    records = run_distributed(_async_step_body, world_size=2, timeout_s=60)[0]
    assert records == [(4, 1, False), (8, 0, True)]


def _profiled_body(rank: int, world_size: int) -> list:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comm.all_reduce(torch.ones(4))
        comm.all_gather_into_tensor(torch.empty(2 * world_size), torch.ones(2))
        comm.all_reduce(torch.ones(4), async_op=True).wait()
    return [e.name for e in prof.events() if e.name.startswith("comm.")]


def test_each_collective_is_a_named_range():
    names = run_distributed(_profiled_body, world_size=2, timeout_s=60)[0]
    assert names == ["comm.all_reduce", "comm.all_gather", "comm.all_reduce"]
