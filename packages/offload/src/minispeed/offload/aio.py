"""Async tensor I/O: read or write a tensor at a file offset, now or later, many at once.

    io = AsyncIO(AioConfig(block_bytes=1 << 20, queue_depth=8))
    req = io.submit_write(t, "/nvme/x.swp", offset=0)   # returns at once
    ...                                                  # compute meanwhile
    req.wait()                                           # raises OSError naming the path on failure
    io.read(t, "/nvme/x.swp")                           # synchronous

The work runs on the C++ engine (``csrc/aio``: ``thread_count * queue_depth`` worker threads doing
pread/pwrite of ``block_bytes`` each; Note [the portable back end]) or, when the op cannot be built,
on `.aio_reference` (the same contract in Python threads). io_uring and libaio back ends are
not compiled: neither library is required, and the thread pool reaches the disk's rate (see
docs/packages/offload.md for the measurements).

Buffers: `AsyncIO.aligned_empty` (and the swapper's pools, through `io_buffer`) back every whole
2 MiB of a buffer with a transparent huge page where the kernel offers them (Note [I/O buffers
on huge pages]): on this machine's virtual disk that alone takes single-stream O_DIRECT reads
from 0.7x to 1.3-1.6x `dd`'s rate.

O_DIRECT: by default (``direct=None``) each directory is probed once; where the file system
accepts O_DIRECT (ext4, xfs on a disk), requests whose buffer address, size and offset are
multiples of `ALIGN` bypass the page cache, others go through it; where it refuses (tmpfs,
some network file systems) everything is buffered and the probe says so in the log once.
``direct=True`` makes an unaligned request an error instead; ``direct=False`` never uses it.
`AsyncIO.aligned_empty` allocates tensors that always qualify.

Failure is never a silent partial tensor: a missing directory or file, a full disk (ENOSPC), a
file shorter than the read (a swap file truncated under a running job) raise ``OSError`` (with
``errno`` and ``filename`` set) from ``wait()`` / ``read()`` / ``write()``, naming the path, the
byte range and the fix. After a failed read the tensor's contents are unspecified.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path

import torch

from minispeed.core import ranges
from minispeed.core.logging import get_logger
from minispeed.offload import aio_reference
from minispeed.offload.config import AioConfig
from minispeed.offload.ops import load_op

__all__ = [
    "ALIGN",
    "HUGE_PAGE",
    "AsyncIO",
    "IORequest",
    "direct_io_supported",
    "io_buffer",
    "io_busy_seconds",
]

#: Alignment (bytes) of buffer address, size and offset for O_DIRECT: 4096 covers every sector
#: size in use (512 B and 4 KiB).
ALIGN = 4096
#: A transparent huge page (x86-64 and arm64 with 4 KiB base pages): Note [I/O buffers on huge pages].
HUGE_PAGE = 2 << 20


# Note [I/O buffers on huge pages]
# An O_DIRECT request moves data between the device and the buffer's physical pages. From a
# buffer of 4 KiB pages a 1 MiB block is 256 scattered pages, and on a virtual disk the cost of
# a request grows with the distinct pages it names: measured here (1 GiB, O_DIRECT, one 1 MiB
# pread at a time, a C loop, medians of 5 interleaved rounds), a 64 MiB buffer of 4 KiB pages
# read at 0.66x `dd`'s rate, the same loop into one reused 1 MiB buffer (dd's way: 256 pages,
# the same ones every time) at 0.9-1.0x, and into 2 MiB huge pages at 1.3-1.7x (one physically
# contiguous segment per block). The number of requests was the same (1,024 per GiB), so it is
# the pages, not the splitting of requests. So `io_buffer` maps its memory itself (anonymous,
# 2 MiB-aligned) and asks for transparent huge pages (madvise MADV_HUGEPAGE: the kernel's default
# policy "madvise" grants them only when asked) for every whole huge page of the buffer; the
# tail (< 2 MiB) keeps 4 KiB pages, so the resident bytes never exceed the buffer's. Where the
# kernel has no THP (or refuses the advice) the buffer is an ordinary one: same contract.
def io_buffer(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 tensor of ``nbytes`` rounded up to `ALIGN`, its address `ALIGN`-aligned
    (O_DIRECT-ready) and, from 2 MiB up, 2 MiB-aligned with its whole huge pages advised to be
    transparent huge pages (Note [I/O buffers on huge pages]). Uninitialized. Bytes held: the
    rounded size (plus at most 2 MiB of address space that is never touched)."""
    padded = -(-nbytes // ALIGN) * ALIGN
    if padded < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        raw = torch.empty(padded + ALIGN, dtype=torch.uint8)
        start = (-raw.data_ptr()) % ALIGN
        return raw[start : start + padded]
    region = mmap.mmap(-1, padded + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = (-raw.data_ptr()) % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, padded // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # no THP in this kernel: 4 KiB pages, the same buffer otherwise
        pass
    return raw[start : start + padded]


_log = get_logger("offload.aio")
_direct_probe: dict[str, bool] = {}
_probe_lock = threading.Lock()

_FIXES = {
    errno.ENOENT: "the file or its directory does not exist: create the directory (check "
    "nvme_path), or the swap file was deleted under a running job",
    errno.ENOSPC: "the file system is full: free space or point nvme_path at a larger disk",
    errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota",
    errno.EACCES: "permission denied: make the directory writable by this user",
    errno.EROFS: "the file system is read-only: choose a writable nvme_path",
    errno.EINVAL: "the file system refused the request (O_DIRECT unsupported or misaligned): "
    "pass direct=False",
}


# Note [the O_DIRECT probe caches answers, not accidents]
# The probe writes and reads one 4 KiB block with O_DIRECT. The file system's answer (it works;
# EINVAL: this file system refuses O_DIRECT) holds for the life of the process and is cached.
# A failure that says nothing about O_DIRECT (ENOSPC on a full disk, EDQUOT, EACCES, EIO...) is
# answered "no" for this request only and probed again next time, so a disk that was full for
# a moment does not lose O_DIRECT for the rest of the run.
_REFUSALS = (errno.EINVAL, errno.EOPNOTSUPP)


def direct_io_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in ``directory`` accept O_DIRECT reads and writes (probed once, cached;
    see Note [the O_DIRECT probe caches answers, not accidents])."""
    key = str(Path(directory).resolve())
    with _probe_lock:
        if key in _direct_probe:
            return _direct_probe[key]
        supported, definitive = _probe(Path(key))
        if not definitive:
            return False
        _direct_probe[key] = supported
        _log.info(
            "aio: %s %s",
            key,
            "supports O_DIRECT: aligned requests bypass the page cache"
            if supported
            else "does not support O_DIRECT (e.g. tmpfs): buffered I/O through the page cache",
        )
        return supported


def _probe(directory: Path) -> tuple[bool, bool]:
    """(O_DIRECT works, the answer is the file system's and may be cached)."""
    if not hasattr(os, "O_DIRECT"):
        return False, True
    if not directory.is_dir():
        return False, False
    probe = directory / f".minispeed-direct-probe-{os.getpid()}-{threading.get_ident()}"
    buf = mmap.mmap(-1, ALIGN)  # page-aligned
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError as error:
        return False, error.errno in _REFUSALS
    try:
        ok = os.pwrite(fd, buf, 0) == ALIGN and os.preadv(fd, [buf], 0) == ALIGN
        return ok, True
    except OSError as error:
        return False, error.errno in _REFUSALS
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)
        buf.close()


def io_busy_seconds() -> float:
    """Seconds so far during which at least one request of any `AsyncIO` in this process was in
    flight, overlapping requests counted once (Note [the I/O busy clock] in csrc/aio/aio.h).
    Bytes moved over its growth between two points is the rate the disk gave this process while
    it used it. The compiled engines and the reference engines keep one clock each; this is
    their sum (a process uses one kind)."""
    op = load_op()
    return (op.io_busy_seconds() if op is not None else 0.0) + aio_reference.io_busy_seconds()


class IORequest:
    """One submitted read or write. Holds its tensor until `wait` (the buffer must live)."""

    def __init__(
        self, io: AsyncIO, rid: int, tensor: torch.Tensor, path: str, offset: int, write: bool
    ) -> None:
        self._io = io
        self._rid = rid
        self._tensor: torch.Tensor | None = tensor
        self.path = path
        self.offset = offset
        self.nbytes = tensor.numel() * tensor.element_size()
        self.write = write
        self._error: OSError | None = None
        self._done = False

    @property
    def done(self) -> bool:
        """Whether `wait` has returned (or raised) for this request."""
        return self._done

    def wait(self) -> int:
        """Block until complete; returns the bytes moved, or raises the request's ``OSError``."""
        if not self._done:
            with ranges.range("offload.aio_wait"):
                nbytes, err, message = self._io._engine.wait(self._rid)
            self._done = True
            self._tensor = None
            if err:
                self._error = _error(err, message, self)
            elif nbytes != self.nbytes:
                self._error = _error(errno.EIO, f"moved {nbytes} of {self.nbytes} bytes", self)
        if self._error is not None:
            raise self._error
        return self.nbytes

    def __del__(self) -> None:
        # A request dropped without wait() must still finish before its tensor may be freed.
        if not self._done and self._tensor is not None:
            try:
                self._io._engine.wait(self._rid)
            except Exception:
                pass


def _error(err: int, message: str, req: IORequest) -> OSError:
    what = "write" if req.write else "read"
    where = f"{req.path} bytes [{req.offset}, {req.offset + req.nbytes})"
    if err == aio_reference.SHORT_READ:
        return OSError(
            errno.EIO,
            f"{what} of {where}: {message}: the file is shorter than expected (truncated or "
            "replaced under a running job); the tensor was NOT filled: restore the file or restart "
            "from a checkpoint",
            req.path,
        )
    fix = _FIXES.get(err, "see the errno above")
    return OSError(err, f"{what} of {where} failed: {message}: {fix}", req.path)


class AsyncIO:
    """Submit tensor reads/writes to files; wait on each, or on all. See the module docstring.

    ``backend``: ``"threadpool"`` (the C++ engine), ``"reference"`` (Python threads), or ``None``
    (the C++ engine when the op builds, else the reference).

    Costs: each request costs one ``open`` plus ``ceil(nbytes / block_bytes)`` pread/pwrite calls
    spread over ``config.workers`` threads; no copy of the data in user space (O_DIRECT moves it
    by DMA, buffered I/O copies it once into the page cache).
    """

    def __init__(
        self,
        config: AioConfig | None = None,
        *,
        direct: bool | None = None,
        backend: str | None = None,
    ) -> None:
        self.config = config or AioConfig()
        self.direct = direct
        if backend not in (None, "threadpool", "reference"):
            raise ValueError(
                f"AsyncIO backend must be 'threadpool' or 'reference', got {backend!r}"
            )
        op = load_op() if backend != "reference" else None
        workers, block = self.config.workers, self.config.block_bytes
        if op is not None:
            self._engine = op.AioEngine(workers, block, self.config.single_submit)
            self.backend = "threadpool"
        elif backend == "threadpool":
            raise RuntimeError("AsyncIO(backend='threadpool'): the offload op cannot be built here")
        else:
            self._engine = aio_reference.ReferenceEngine(workers, block, self.config.single_submit)
            self.backend = "reference"
        self._inflight: list[IORequest] = []

    # -- buffers -----------------------------------------------------------------------------
    @staticmethod
    def aligned_empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialized 1-D tensor whose address and byte size are multiples of `ALIGN`,
        on huge pages from 2 MiB up (`io_buffer`).

        Allocates ``numel * itemsize`` rounded up to ALIGN; returns the ``numel``-element view
        (it keeps the allocation alive).
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        return io_buffer(numel * itemsize).view(dtype)[:numel]

    # -- requests ----------------------------------------------------------------------------
    def _uses_direct(self, tensor: torch.Tensor, path: str, offset: int) -> bool:
        if self.direct is False:
            return False
        nbytes = tensor.numel() * tensor.element_size()
        aligned = tensor.data_ptr() % ALIGN == 0 and nbytes % ALIGN == 0 and offset % ALIGN == 0
        if self.direct is True:
            if not aligned:
                raise ValueError(
                    f"O_DIRECT {path}: buffer address {tensor.data_ptr():#x}, size {nbytes} and "
                    f"offset {offset} must all be multiples of {ALIGN}; allocate with "
                    "AsyncIO.aligned_empty and pad sizes, or use direct=None (buffered when unaligned)"
                )
            return True
        return aligned and direct_io_supported(Path(path).parent)

    def _submit(
        self,
        tensor: torch.Tensor,
        path: str | os.PathLike[str],
        offset: int,
        write: bool,
        fsync: bool,
    ) -> IORequest:
        path = os.fspath(path)
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise TypeError(f"AsyncIO needs a CPU tensor for {path}, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ValueError(
                f"AsyncIO: the tensor for {path} is not contiguous; call .contiguous()"
            )
        if offset < 0:
            raise ValueError(f"AsyncIO: offset for {path} must be >= 0, got {offset}")
        direct = self._uses_direct(tensor, path, offset)
        nbytes = tensor.numel() * tensor.element_size()
        if self.backend == "threadpool":
            rid = self._engine.submit(path, tensor.data_ptr(), nbytes, offset, write, direct, fsync)
        else:
            view = memoryview(tensor.detach().view(-1).view(torch.uint8).numpy())
            rid = self._engine.submit(path, view, nbytes, offset, write, direct, fsync)
        req = IORequest(self, rid, tensor, path, offset, write)
        if not self.config.overlap_events:
            req.wait()  # see AioConfig.overlap_events
        else:
            self._inflight = [r for r in self._inflight if not r.done]
            self._inflight.append(req)
        return req

    def submit_write(
        self,
        tensor: torch.Tensor,
        path: str | os.PathLike[str],
        offset: int = 0,
        *,
        fsync: bool = False,
    ) -> IORequest:
        """Start writing ``tensor``'s bytes to ``path`` at ``offset`` (file created if absent).

        ``fsync=True`` flushes the file to the device before the request completes.
        """
        with ranges.range("offload.aio_submit"):
            return self._submit(tensor, path, offset, True, fsync)

    def submit_read(
        self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0
    ) -> IORequest:
        """Start filling ``tensor`` from ``path`` at ``offset``; the file must hold all its bytes."""
        with ranges.range("offload.aio_submit"):
            return self._submit(tensor, path, offset, False, False)

    def write(
        self,
        tensor: torch.Tensor,
        path: str | os.PathLike[str],
        offset: int = 0,
        *,
        fsync: bool = False,
    ) -> int:
        """Write now (submit + wait). Returns the bytes written."""
        return self.submit_write(tensor, path, offset, fsync=fsync).wait()

    def read(self, tensor: torch.Tensor, path: str | os.PathLike[str], offset: int = 0) -> int:
        """Read now (submit + wait). Returns the bytes read."""
        return self.submit_read(tensor, path, offset).wait()

    def wait_all(self) -> None:
        """Wait for every request not yet waited on; raises the first error after waiting for all."""
        first: OSError | None = None
        for req in self._inflight:
            if req.done:
                continue
            try:
                req.wait()
            except OSError as err:
                first = first or err
        self._inflight = []
        if first is not None:
            raise first

    @property
    def pending(self) -> int:
        """Requests submitted and not yet waited on."""
        return self._engine.pending()
