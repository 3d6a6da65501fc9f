"""Every I/O failure is a clear OSError naming the path and the fix, never a silent partial tensor."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from minispeed.offload import AioConfig, AsyncIO
from minispeed.offload.ops import load_op

BACKENDS = ["threadpool", "reference"]


def _io(backend: str, **kw) -> AsyncIO:
    if backend == "threadpool" and load_op() is None:
        pytest.skip("the offload op cannot be built here")
    return AsyncIO(AioConfig(block_bytes=8192, queue_depth=2), backend=backend, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_directory_names_the_path(tmp_path: Path, backend) -> None:
    path = tmp_path / "no" / "such" / "dir" / "x.bin"
    with pytest.raises(FileNotFoundError, match="create the directory") as info:
        _io(backend).write(torch.zeros(10), path)
    assert info.value.filename == str(path) and str(path) in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_read_of_a_truncated_file_raises(tmp_path: Path, backend) -> None:
    io = _io(backend)
    path = tmp_path / "x.bin"
    io.write(torch.arange(10_000, dtype=torch.float32), path)
    os.truncate(path, 30_000)  # the file now holds 7,500 of the 10,000 floats
    with pytest.raises(OSError, match="shorter than expected") as info:
        io.read(torch.empty(10_000), path)
    assert info.value.errno == errno.EIO and str(path) in str(info.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_enospc_from_dev_full_raises(backend) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with pytest.raises(OSError, match="file system is full") as info:
        _io(backend).write(torch.zeros(100_000), "/dev/full")
    assert info.value.errno == errno.ENOSPC


def test_enospc_on_a_tiny_tmpfs_raises(tmp_path: Path) -> None:
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); /dev/full covers ENOSPC"
        )
    try:
        with pytest.raises(OSError, match="file system is full") as info:
            _io("threadpool").write(torch.zeros(1 << 16), mnt / "big.bin")  # 256 KiB > 64 KiB
        assert info.value.errno == errno.ENOSPC and "big.bin" in str(info.value)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_unaligned_request_with_direct_io_forced_is_refused(tmp_path: Path) -> None:
    io = _io("threadpool", direct=True)
    with pytest.raises(ValueError, match="multiples of 4096"):
        io.write(torch.zeros(1000), tmp_path / "u.bin")  # 4000 bytes: not a multiple of 4096


def test_bad_tensors_are_refused_before_any_io(tmp_path: Path) -> None:
    io = _io("threadpool")
    with pytest.raises(ValueError, match="contiguous"):
        io.write(torch.zeros(4, 4).t(), tmp_path / "c.bin")
    with pytest.raises(ValueError, match="offset"):
        io.write(torch.zeros(4), tmp_path / "c.bin", offset=-1)


def _probe_with_pwrite_failing(tmp_path: Path, err: int) -> tuple[bool, bool, bool]:
    """direct_io_supported while pwrite fails with ``err``, then again once it works, and what
    a fresh probe says: (during, after, fresh)."""
    import minispeed.offload.aio as aio

    real = aio.os.pwrite

    def failing(fd, data, offset):
        raise OSError(err, os.strerror(err))

    aio.os.pwrite = failing
    try:
        during = aio.direct_io_supported(tmp_path)
    finally:
        aio.os.pwrite = real
    after = aio.direct_io_supported(tmp_path)
    fresh = aio._probe(tmp_path)[0]
    aio._direct_probe.pop(str(tmp_path.resolve()), None)
    return during, after, fresh


def test_direct_io_probe_on_a_full_disk_is_not_cached(tmp_path: Path) -> None:
    """A full disk says nothing about O_DIRECT: once space is back, the probe answers again."""
    during, after, fresh = _probe_with_pwrite_failing(tmp_path, errno.ENOSPC)
    assert during is False
    assert after == fresh
    if not fresh:
        pytest.skip("this file system refuses O_DIRECT: the two answers cannot differ")


def test_direct_io_refusal_is_cached(tmp_path: Path) -> None:
    """EINVAL is the file system's answer: cached for the process."""
    during, after, _ = _probe_with_pwrite_failing(tmp_path, errno.EINVAL)
    assert during is False and after is False
