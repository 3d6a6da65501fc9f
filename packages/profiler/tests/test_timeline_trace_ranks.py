"""`python -m minispeed.profiler trace` writes one Chrome trace with both ranks, compute and
each collective on its own named track."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from profiler_testlib import overlapping_slices

from minispeed.profiler.timeline import events_on, is_collective, merge_traces, track_names

STEP_SCRIPT = Path(__file__).with_name("traced_ddp_step.py")


def test_trace_command_merges_two_gloo_ranks_into_named_tracks(tmp_path):
    pytest.importorskip(
        "minispeed.comm", reason="the traced step runs collectives through minispeed.comm"
    )
    out = tmp_path / "step.json"
    cmd = [
        sys.executable,
        "-m",
        "minispeed.profiler",
        "trace",
        "--nproc",
        "2",
        "--out",
        str(out),
        str(STEP_SCRIPT),
    ]
    subprocess.run(cmd, check=True, timeout=240)
    trace = json.loads(out.read_text())
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert processes == {"rank 0", "rank 1"}
    for rank in (0, 1):
        tracks = track_names(trace, rank)
        assert tracks[0] == "compute" or "compute" in tracks
        assert "comm.all_reduce" in tracks  # the range and the c10d call inside it
        assert any(t.startswith("gloo:all_reduce") for t in tracks)  # gloo's worker thread
        names = {e["name"] for e in events_on(trace, rank, "compute")}
        # forward and backward compute, and the phase range around backward, stay on compute
        assert {"aten::addmm", "aten::mm", "zero.backward"} <= names
        assert "zero.backward" not in tracks
        inside = {e["name"] for e in events_on(trace, rank, "comm.all_reduce")}
        assert "c10d::allreduce_" in inside and "aten::addmm" not in inside
        assert not any("Profiler" in t for t in tracks)  # the recorder's own span is dropped
    assert overlapping_slices(trace) == []


def test_merge_files_nested_events_under_their_collective_and_threads_apart(tmp_path):
    def x(name, ts, dur, tid=7):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}

    rank0 = [x("aten::mm", 0, 5), x("comm.all_gather", 10, 10), x("c10d::_allgather_base_", 11, 3),
             x("aten::add", 25, 1), x("gloo:all_gather", 12, 6, tid=9), x("aten::copy_", 13, 1, tid=9)]  # fmt: skip
    files = []
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        path.write_text(json.dumps({"traceEvents": rank0}))
        files.append(path)
    trace = merge_traces(files, tmp_path / "merged.json")
    assert track_names(trace, 1) == ["compute", "comm.all_gather", "gloo:all_gather"]
    assert [e["name"] for e in events_on(trace, 1, "compute")] == ["aten::mm", "aten::add"]
    assert [e["name"] for e in events_on(trace, 1, "comm.all_gather")] == [
        "comm.all_gather",
        "c10d::_allgather_base_",
    ]
    assert [e["name"] for e in events_on(trace, 0, "gloo:all_gather")] == [
        "gloo:all_gather",
        "aten::copy_",
    ]
    assert json.loads((tmp_path / "merged.json").read_text()) == trace


def _x(name, ts, dur, tid=7):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def test_phases_stay_on_compute_collectives_get_a_track_each_thread_its_own(tmp_path):
    # A ZeRO stage-1 step as minispeed.zero marks it: the reduce-scatter runs inside the
    # backward phase, the all-gather inside the step phase, and two gloo worker threads both
    # run an all-reduce, at overlapping times.
    events = [
        _x("zero.backward", 0, 100), _x("aten::mm", 10, 10), _x("comm.reduce_scatter", 40, 10),
        _x("c10d::allreduce_", 41, 4), _x("aten::add", 95, 5.0004),  # ends past its parent
        _x("zero.step", 110, 90), _x("aten::mul", 120, 10), _x("comm.all_gather", 150, 10),
        _x("gloo:all_reduce", 42, 18, tid=11), _x("aten::copy_", 43, 2, tid=11),
        _x("gloo:all_reduce", 45, 25, tid=12), _x("aten::add", 300, 1, tid=12),
    ]  # fmt: skip
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = merge_traces([path], tmp_path / "merged.json")
    assert track_names(trace, 0) == [
        "compute", "compute [thread 2]", "comm.all_gather", "comm.reduce_scatter",
        "gloo:all_reduce [thread 1]", "gloo:all_reduce [thread 2]",
    ]  # fmt: skip
    assert [e["name"] for e in events_on(trace, 0, "compute")] == [
        "zero.backward", "aten::mm", "aten::add", "zero.step", "aten::mul",
    ]  # fmt: skip
    assert [e["name"] for e in events_on(trace, 0, "comm.reduce_scatter")] == [
        "comm.reduce_scatter", "c10d::allreduce_",
    ]  # fmt: skip
    assert [e["name"] for e in events_on(trace, 0, "gloo:all_reduce [thread 1]")] == [
        "gloo:all_reduce", "aten::copy_",
    ]  # fmt: skip
    assert overlapping_slices(trace) == []


def test_what_counts_as_a_collective():
    for name in ("comm.all_reduce", "gloo:all_gather", "nccl:reduce_scatter", "c10d::allreduce_",
                 "zero3.gather", "zero3.reduce_scatter", "zero3.qgz_reduce_scatter",
                 "pipeline.send", "pipeline.recv", "moe.reduce_gradients"):  # fmt: skip
        assert is_collective(name), name
    for name in ("zero.backward", "zero.step", "zero.grads.finish", "zero3.release",
                 "pipeline.forward", "moe.experts", "aten::mm", "AddmmBackward0",
                 "autograd::engine::evaluate_function: AddmmBackward0"):  # fmt: skip
        assert not is_collective(name), name


def test_gpu_streams_get_their_own_tracks_and_nccl_kernels_theirs(tmp_path):
    def k(name, ts, dur, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0,
                "tid": stream}  # fmt: skip

    events = [
        _x("aten::mm", 0, 10), _x("nccl:all_reduce", 20, 5),
        k("sm90_xmma_gemm", 2, 6, 7), k("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 21, 30, 13),
        k("elementwise_kernel", 40, 2, 7),
    ]  # fmt: skip
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = merge_traces([path], tmp_path / "merged.json")
    assert track_names(trace, 0) == [
        "compute", "gpu stream 7", "nccl:all_reduce", "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
    ]  # fmt: skip
    assert [e["name"] for e in events_on(trace, 0, "gpu stream 7")] == [
        "sm90_xmma_gemm", "elementwise_kernel",
    ]  # fmt: skip
    assert overlapping_slices(trace) == []
