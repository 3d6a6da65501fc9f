"""AsyncIO moves a tensor's exact bytes to a file offset and back: sync, async, many in flight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minispeed.offload import AioConfig, AsyncIO, direct_io_supported
from minispeed.offload.ops import load_op

BACKENDS = ["threadpool", "reference"]


def _io(backend: str, **kw) -> AsyncIO:
    if backend == "threadpool" and load_op() is None:
        pytest.skip("the offload op cannot be built here")
    config = AioConfig(**{"block_bytes": 8192, "queue_depth": 4, **kw})
    return AsyncIO(config, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_sync_write_then_read_at_offsets_gives_the_same_bytes(
    tmp_path: Path, backend, dtype
) -> None:
    io = _io(backend)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(10_007, generator=gen).to(dtype)  # odd size: not a multiple of any block
    b = torch.randn(333, generator=gen).to(dtype)
    path = tmp_path / "x.bin"
    nbytes_a = a.numel() * a.element_size()
    assert io.write(a, path, 0) == nbytes_a
    assert io.write(b, path, nbytes_a + 100) == b.numel() * b.element_size()
    a2, b2 = torch.empty_like(a), torch.empty_like(b)
    io.read(b2, path, nbytes_a + 100)
    io.read(a2, path, 0)
    assert torch.equal(a.view(torch.uint8), a2.view(torch.uint8))
    assert torch.equal(b.view(torch.uint8), b2.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_requests_in_flight_complete_in_any_wait_order(tmp_path: Path, backend) -> None:
    io = _io(backend)
    tensors = [torch.full((5000 + i,), float(i)) for i in range(16)]
    writes = [io.submit_write(t, tmp_path / f"{i}.bin") for i, t in enumerate(tensors)]
    assert io.pending == 16 or io.pending > 0
    for req in reversed(writes):
        req.wait()
    outs = [torch.empty_like(t) for t in tensors]
    reads = [io.submit_read(o, tmp_path / f"{i}.bin") for i, o in enumerate(outs)]
    io.wait_all()
    assert all(r.done for r in reads) and io.pending == 0
    for t, o in zip(tensors, outs):
        assert torch.equal(t, o)


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_submit_and_no_overlap_give_the_same_bytes(tmp_path: Path, backend) -> None:
    serial = _io(backend, single_submit=True, overlap_events=False)
    t = torch.randn(70_001)
    req = serial.submit_write(t, tmp_path / "s.bin")
    assert req.done  # overlap_events=False: submit returned after the write completed
    back = torch.empty_like(t)
    serial.read(back, tmp_path / "s.bin")
    assert torch.equal(t, back)


def test_direct_io_is_used_where_the_file_system_supports_it(tmp_path: Path) -> None:
    io = _io("threadpool", block_bytes=1 << 16)
    t = AsyncIO.aligned_empty(3 * 4096)  # 48 KiB, 4 KiB-aligned
    assert t.data_ptr() % 4096 == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    if direct_io_supported(tmp_path):
        strict = AsyncIO(io.config, direct=True)
        strict.write(t, tmp_path / "d.bin", 4096)
        back = AsyncIO.aligned_empty(t.numel())
        strict.read(back, tmp_path / "d.bin", 4096)
        assert torch.equal(t, back)
    # An unaligned request on the same file system goes through the page cache and still works.
    odd = torch.arange(1001, dtype=torch.float32)
    io.write(odd, tmp_path / "odd.bin", 3)
    back_odd = torch.empty_like(odd)
    io.read(back_odd, tmp_path / "odd.bin", 3)
    assert torch.equal(odd, back_odd)
