"""The I/O busy clock (Note [the I/O busy clock] in csrc/aio/aio.h): seconds with at least one
request in flight, overlapping requests counted once, standing still while idle; the compiled
engine and the pure-Python reference keep it alike."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from minispeed.offload import AioConfig, AsyncIO, io_busy_seconds
from minispeed.offload.ops import load_op


def _io(backend: str) -> AsyncIO:
    if backend == "threadpool" and load_op() is None:
        pytest.skip("the offload op cannot be built here")
    return AsyncIO(AioConfig(block_bytes=1 << 16, queue_depth=8), backend=backend)


@pytest.mark.parametrize("backend", ["threadpool", "reference"])
def test_overlapping_requests_count_once_and_idle_time_not_at_all(tmp_path: Path, backend):
    io = _io(backend)
    buf = AsyncIO.aligned_empty(1 << 18)  # 1 MiB
    buf.fill_(3.0)
    before = io_busy_seconds()
    start = time.perf_counter()
    reqs = [io.submit_write(buf, tmp_path / f"{i}.bin", fsync=True) for i in range(16)]
    latencies = []
    for r in reqs:
        r.wait()
        latencies.append(time.perf_counter() - start)  # each request's span, at least
    wall = time.perf_counter() - start
    busy = io_busy_seconds() - before
    assert 0 < busy <= wall  # a union of spans inside [start, end], never their sum
    assert sum(latencies) > wall  # the 16 spans overlapped, so a sum would have exceeded it
    idle = io_busy_seconds()
    time.sleep(0.05)
    assert io_busy_seconds() == idle  # nothing in flight: the clock stands still
    out = AsyncIO.aligned_empty(1 << 18)
    io.read(out, tmp_path / "0.bin")
    assert io_busy_seconds() > idle and bool((out == 3.0).all())
