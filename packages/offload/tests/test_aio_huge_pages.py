"""I/O buffers on transparent huge pages (Note [I/O buffers on huge pages] in aio.py): the engine's
and the swapper's buffers get them, hold no more memory than asked, and move the same bytes as
the pure-Python reference engine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from minispeed.offload import AioConfig, AsyncIO, direct_io_supported
from minispeed.offload.aio import ALIGN, HUGE_PAGE, io_buffer
from minispeed.offload.ops import load_op
from minispeed.offload.swapper import BufferPool

MiB = 1 << 20


def _mapping(address: int) -> dict[str, int]:
    """This process's /proc/self/smaps fields (kB, or a flag) of the mapping holding `address`."""
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                if inside:
                    break
                inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
            elif inside:
                key, _, value = line.partition(":")
                if value.split() and value.split()[0].isdigit():
                    fields[key] = int(value.split()[0])
    return fields


def _thp_offered() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


needs_thp = pytest.mark.skipif(not _thp_offered(), reason="no transparent huge pages here")


@needs_thp
def test_engine_buffers_sit_on_huge_pages() -> None:
    buf = AsyncIO.aligned_empty(16 * MiB // 4)  # 16 MiB of float32
    buf.fill_(1.0)  # touched: the kernel backs it now
    assert buf.data_ptr() % HUGE_PAGE == 0 and buf.numel() == 4 * MiB
    smaps = _mapping(buf.data_ptr())
    if "THPeligible" not in smaps:
        pytest.skip("this kernel's smaps has no THPeligible field")
    assert smaps["THPeligible"] == 1
    assert smaps.get("AnonHugePages", 0) > 0  # at least some granted (memory may be fragmented)


@needs_thp
def test_swapper_pool_buffers_sit_on_huge_pages() -> None:
    pool = BufferPool(2, 3 * MiB, torch.float32, pin=False)  # 12 MiB each
    for buf in pool.buffers:
        assert buf.data_ptr() % HUGE_PAGE == 0 and buf.numel() == 3 * MiB
        smaps = _mapping(buf.data_ptr())
        assert smaps.get("THPeligible", 1) == 1


@needs_thp
def test_the_tail_keeps_small_pages_so_no_more_memory_is_held() -> None:
    """3 MiB + 4 KiB: one huge page and 260 small ones, so touching every byte makes it resident
    at its size, not at the 4 MiB of two huge pages."""
    buf = io_buffer(3 * MiB + ALIGN)
    assert buf.numel() == 3 * MiB + ALIGN and buf.dtype == torch.uint8
    buf.fill_(7)
    assert _mapping(buf.data_ptr())["Rss"] * 1024 <= 3 * MiB + ALIGN


def test_small_buffers_are_ordinary_and_aligned() -> None:
    for nbytes in (1, ALIGN, MiB + 1):
        buf = io_buffer(nbytes)
        assert buf.data_ptr() % ALIGN == 0 and buf.numel() == -(-nbytes // ALIGN) * ALIGN
    t = AsyncIO.aligned_empty(1000, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.numel() == 1000 and t.data_ptr() % ALIGN == 0


@pytest.mark.parametrize(("block", "depth"), [(1 * MiB, 1), (4 * MiB, 8)])
def test_huge_page_buffers_move_the_bytes_the_reference_moves(tmp_path: Path, block, depth):
    """The compiled engine writes from and reads into huge-page buffers (O_DIRECT where the file
    system takes it); the pure-Python reference engine reads and writes the same files into
    4 KiB-page tensors: every byte agrees both ways."""
    if load_op() is None:
        pytest.skip("the offload op cannot be built here")
    config = AioConfig(block_bytes=block, queue_depth=depth)
    engine = AsyncIO(config, backend="threadpool")
    reference = AsyncIO(config, backend="reference")
    direct = direct_io_supported(tmp_path)
    gen = torch.Generator().manual_seed(0)
    data = AsyncIO.aligned_empty(6 * MiB)  # 24 MiB: 12 huge pages
    data.copy_(torch.randn(data.numel(), generator=gen))
    plain = torch.randn(data.numel(), generator=gen)
    engine.write(data, tmp_path / "a.bin", 0)
    reference.write(plain, tmp_path / "b.bin", 0)
    got_ref, got_engine = torch.empty_like(plain), AsyncIO.aligned_empty(data.numel())
    reference.read(got_ref, tmp_path / "a.bin")
    engine.read(got_engine, tmp_path / "b.bin")
    assert torch.equal(got_ref.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(got_engine.view(torch.uint8), plain.view(torch.uint8))
    assert engine._uses_direct(data, str(tmp_path / "a.bin"), 0) == direct
