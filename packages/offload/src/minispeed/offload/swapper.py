"""Swap tensors to files and back through a fixed pool of aligned (optionally pinned) host buffers.

Reading order: `SwapDir` (this process's directory of swap files, stale ones cleaned),
`BufferPool` (the only host memory a swapped tensor ever occupies), `SwapState` and
`SwappedTensor` (one tensor's explicit state machine), `TensorSwapper` (the moves).

Host memory held: ``buffer_count * buffer_numel * itemsize`` bytes for the pool, whatever the
number or size of the tensors swapped; everything else lives in files (``numel * itemsize`` each,
padded to 4 KiB). A swap-in or swap-out moves ``numel * itemsize`` bytes over the disk; at a disk
rate of R B/s it takes ``numel * itemsize / R`` seconds, which `.swapped` hides behind compute
by prefetching (see docs/packages/offload.md, "How the pipelined swap hides latency").
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import fcntl
import os
import shutil
import time
import weakref
from collections import deque
from pathlib import Path

import torch

from minispeed.core import ranges
from minispeed.core.accelerator import get_accelerator
from minispeed.core.logging import get_logger
from minispeed.offload.aio import ALIGN, AsyncIO, IORequest, io_buffer
from minispeed.offload.config import AioConfig

__all__ = [
    "BufferPool",
    "SwapCounters",
    "SwapDir",
    "SwapState",
    "SwappedTensor",
    "TensorSwapper",
    "check_free_space",
]

_log = get_logger("offload.swapper")
_PREFIX = "minispeed-swap-"
_LOCK = "owner.lock"


def _check_writable_dir(path: Path, key: str) -> None:
    if not path.exists():
        raise FileNotFoundError(
            f"{key}={str(path)!r} does not exist: create the directory (mkdir -p) or point "
            f"{key} at an existing directory on a fast local disk"
        )
    if not path.is_dir():
        raise NotADirectoryError(f"{key}={str(path)!r} is not a directory: point it at one")
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(
            f"{key}={str(path)!r} is not writable by this user: fix its permissions or choose "
            "another directory"
        )


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def clean_stale(root: Path) -> list[Path]:
    """Remove swap directories under ``root`` whose owning process is gone; returns them.

    See Note [stale swap files]. Logs one line per directory removed (files and bytes freed).
    """
    removed = []
    # A half-built directory (SwapDir.__init__ died before renaming it) is stale once it is a
    # minute old; a younger one may be a live process between mkdir and flock.
    building = [d for d in root.glob(".building-" + _PREFIX + "*") if _age(d) > 60]
    for d in sorted(root.glob(_PREFIX + "*")) + building:
        lock = d / _LOCK
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue  # not ours, or half-created: leave it alone
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # a live process holds it
        files = [p for p in d.iterdir() if p.name != _LOCK]
        nbytes = sum(p.stat().st_size for p in files if p.is_file())
        shutil.rmtree(d, ignore_errors=True)
        os.close(fd)
        _log.warning(
            "removed stale swap files of a run that did not exit cleanly: %s (%d files, %d bytes)",
            d,
            len(files),
            nbytes,
        )
        removed.append(d)
    return removed


# Note [stale swap files]
# Each process swaps into its own directory nvme_path/minispeed-swap-<pid>-<n>/ and holds an
# exclusive flock on its owner.lock for as long as it lives. The kernel drops the lock when the
# process dies, however it dies (SIGKILL, OOM kill), so at the next start any such directory whose
# lock can be taken belongs to a dead run and is removed. A pid alone would not do: pids are reused.
# On a normal exit (or when the swapper is closed or collected) the directory is removed at once.


class SwapDir:
    """This process's swap directory under ``root`` (checked, stale siblings cleaned, auto-removed)."""

    _count = 0

    def __init__(self, root: str | os.PathLike[str], key: str = "nvme_path") -> None:
        root_path = Path(root)
        _check_writable_dir(root_path, key)
        clean_stale(root_path)
        # The directory is built under a name clean_stale() does not look at, locked, and only
        # then renamed into place: another process starting at the same moment (the other ranks
        # of this job) can never find it unlocked and remove it as stale.
        while True:  # a fresh name (a leftover with a reused pid and no lock file is skipped)
            SwapDir._count += 1
            name = f"{_PREFIX}{os.getpid()}-{SwapDir._count}"
            self.path = root_path / name
            building = root_path / f".building-{name}"
            if self.path.exists():
                continue
            try:
                building.mkdir()
                break
            except FileExistsError:
                continue
        self._lock_fd = os.open(building / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(building, self.path)  # the open lock fd follows the directory
        # Runs on close(), on garbage collection, and at interpreter exit (weakref.finalize is atexit-aware).
        self._finalizer = weakref.finalize(self, SwapDir._remove, self.path, self._lock_fd)

    @staticmethod
    def _remove(path: Path, lock_fd: int) -> None:
        shutil.rmtree(path, ignore_errors=True)
        os.close(lock_fd)

    def file(self, name: str) -> Path:
        """The swap file for ``name`` inside this directory."""
        return self.path / f"{name}.swp"

    def close(self) -> None:
        """Remove the directory and its files now."""
        self._finalizer()


def _mlock(t: torch.Tensor, key: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    nbytes = t.numel() * t.element_size()
    if libc.mlock(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(nbytes)) != 0:
        err = ctypes.get_errno()
        raise MemoryError(
            f"{key}.pin_memory=true: page-locking {nbytes} bytes of swap buffers failed "
            f"({os.strerror(err)}): raise the locked-memory limit (ulimit -l, RLIMIT_MEMLOCK), "
            f"lower buffer_count, or set {key}.pin_memory false"
        )


class BufferPool:
    """``count`` host buffers of ``numel`` elements, 4 KiB-aligned for O_DIRECT (on huge pages
    where offered: `io_buffer`), pinned if asked.

    Pinned means page-locked: with a GPU, torch's pinned allocator (needed for asynchronous
    copies to the device); on a CPU-only machine, ``mlock`` (the pages never go to swap).
    Bytes held: ``count * roundup(numel * itemsize, 4096)``.
    """

    def __init__(
        self, count: int, numel: int, dtype: torch.dtype, *, pin: bool, key: str = "offload"
    ) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        padded = -(-numel * itemsize // ALIGN) * ALIGN
        self.numel = padded // itemsize  # usable elements per buffer (numel rounded up to 4 KiB)
        self.buffers: list[torch.Tensor] = []
        accel = get_accelerator()
        for _ in range(count):
            if pin and accel.name != "cpu":
                raw = torch.empty(padded + ALIGN, dtype=torch.uint8, pin_memory=True)
                start = (-raw.data_ptr()) % ALIGN
                buf = raw[start : start + padded].view(dtype)
            else:  # huge pages where offered: Note [I/O buffers on huge pages] in aio.py
                buf = io_buffer(padded).view(dtype)
            if pin and accel.name == "cpu":
                _mlock(buf, key)
            self.buffers.append(buf)
        self.free: deque[int] = deque(range(count))
        self.nbytes = count * padded


class SwapState(enum.Enum):
    """Where a `SwappedTensor`'s bytes are (n = numel * itemsize).

    | state | host bytes held | file |
    |---|---|---|
    | NEW | 0 | none yet (reads as zeros, no I/O) |
    | ON_DISK | 0 | n bytes, current |
    | SWAPPING_IN | one pool buffer (being filled) | n bytes, current |
    | IN_BUFFER | one pool buffer (current) | n bytes, stale once the buffer is changed |
    | SWAPPING_OUT | one pool buffer (being written) | being written |
    """

    NEW = "new"
    ON_DISK = "on_disk"
    SWAPPING_IN = "swapping_in"
    IN_BUFFER = "in_buffer"
    SWAPPING_OUT = "swapping_out"


class SwappedTensor:
    """One tensor that lives in a swap file; its state changes only through ``to_<state>``."""

    def __init__(self, name: str, numel: int, path: Path) -> None:
        self.name = name
        self.numel = numel
        self.path = path
        self.state = SwapState.NEW
        self.buffer_index: int | None = None
        self.request: IORequest | None = None

    def _move(self, allowed: tuple[SwapState, ...], to: SwapState) -> None:
        assert self.state in allowed, f"swap {self.name}: {self.state} -> {to} is not a legal move"
        self.state = to

    def to_swapping_in(self, index: int, request: IORequest | None) -> None:
        self._move((SwapState.NEW, SwapState.ON_DISK), SwapState.SWAPPING_IN)
        self.buffer_index, self.request = index, request

    def to_in_buffer(self) -> None:
        self._move((SwapState.SWAPPING_IN,), SwapState.IN_BUFFER)
        self.request = None

    def to_swapping_out(self, request: IORequest) -> None:
        self._move((SwapState.IN_BUFFER,), SwapState.SWAPPING_OUT)
        self.request = request

    def to_filled(self, index: int) -> None:
        """The caller wrote the current value into pool buffer ``index`` (no read): the file is
        stale until the swap-out that must follow."""
        self._move((SwapState.NEW, SwapState.ON_DISK), SwapState.IN_BUFFER)
        self.buffer_index, self.request = index, None

    def to_discarded(self) -> int:
        """IN_BUFFER -> ON_DISK without a write (the buffer was only read, so the file is current);
        returns the freed buffer index."""
        self._move((SwapState.IN_BUFFER,), SwapState.ON_DISK)
        index, self.buffer_index = self.buffer_index, None
        assert index is not None
        return index

    def to_on_disk(self) -> int:
        """Back on disk; returns the buffer index it held (now free)."""
        self._move((SwapState.SWAPPING_OUT,), SwapState.ON_DISK)
        index, self.buffer_index, self.request = self.buffer_index, None, None
        assert index is not None
        return index

    def to_failed(self) -> int:
        """A read or write failed (SWAPPING_IN or SWAPPING_OUT): back to ON_DISK, the file as it
        is (after a failed write: not current); returns the freed buffer index. So the tensor
        can be tried again, or the swapper closed, without a state error."""
        never_written = self.state is SwapState.SWAPPING_IN and self.request is None
        self._move((SwapState.SWAPPING_IN, SwapState.SWAPPING_OUT), SwapState.ON_DISK)
        if never_written:  # a NEW tensor's zeroed buffer, abandoned: still no file
            self.state = SwapState.NEW
        index, self.buffer_index, self.request = self.buffer_index, None, None
        assert index is not None
        return index


class TensorSwapper:
    """Tensors in files under ``nvme_path``, in host memory only while in one of the pool's buffers.

    ``swap_in`` starts a read into a free buffer (waiting for the oldest swap-out when all are
    busy), ``wait_in`` returns the buffer's view, ``swap_out`` starts the write back, ``wait_out``
    frees the buffer. ``config_key`` (e.g. ``"offload_optimizer"``) names the config section in
    every error, so the message points at the key to change.
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike[str],
        *,
        buffer_count: int,
        buffer_numel: int,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool = False,
        aio: AioConfig | None = None,
        config_key: str = "offload",
    ) -> None:
        self.key = config_key
        self.dir = SwapDir(nvme_path, key=f"{config_key}.nvme_path")
        self.pool = BufferPool(buffer_count, buffer_numel, dtype, pin=pin_memory, key=config_key)
        self.dtype = dtype
        self.io = AsyncIO(aio)
        self.tensors: dict[str, SwappedTensor] = {}
        self._writing: deque[SwappedTensor] = deque()  # swap-outs in flight, oldest first
        self.bytes_read = 0
        self.bytes_written = 0
        # Seconds the caller spent blocked on the disk (the part of I/O not hidden by overlap).
        self.wait_s = {"read": 0.0, "write": 0.0}

    def register(self, name: str, numel: int) -> SwappedTensor:
        """A new swapped tensor of ``numel`` elements (state NEW: reads as zeros until written)."""
        if numel > self.pool.numel:
            raise ValueError(
                f"{self.key}: a swapped partition {name!r} of {numel} elements does not fit a "
                f"buffer of {self.pool.numel} elements: raise {self.key}.buffer_size to at least "
                f"{numel} (or cut the partition smaller: sub_group_size)"
            )
        if name in self.tensors:
            raise ValueError(f"{self.key}: {name!r} is already registered")
        st = SwappedTensor(name, numel, self.dir.file(name))
        self.tensors[name] = st
        return st

    def _acquire(self) -> int:
        while not self.pool.free:
            if not self._writing:
                raise RuntimeError(
                    f"{self.key}: all {len(self.pool.buffers)} swap buffers are in use and none is "
                    f"being written back: raise {self.key}.buffer_count or swap out before swapping in"
                )
            self.wait_out(self._writing[0])
        return self.pool.free.popleft()

    def _padded(self, index: int, numel: int) -> torch.Tensor:
        """The buffer view that is read/written: ``numel`` rounded up to 4 KiB (O_DIRECT-aligned)."""
        itemsize = self.pool.buffers[index].element_size()
        return self.pool.buffers[index][: -(-numel * itemsize // ALIGN) * ALIGN // itemsize]

    def swap_in(self, st: SwappedTensor) -> None:
        """Start reading ``st`` into a free buffer (NEW: zero the buffer, no I/O)."""
        with ranges.range("offload.swap_in"):
            index = self._acquire()
            if st.state == SwapState.NEW:
                self.pool.buffers[index][: st.numel].zero_()
                st.to_swapping_in(index, None)
                return
            try:  # overlap_events=false waits in submit: a failure can surface here
                req = self.io.submit_read(self._padded(index, st.numel), st.path)
            except OSError:
                self.pool.free.append(index)
                raise
            st.to_swapping_in(index, req)

    def wait_in(self, st: SwappedTensor) -> torch.Tensor:
        """Finish ``st``'s swap-in; returns its ``numel`` elements in the buffer (valid until swap_out)."""
        if st.state == SwapState.IN_BUFFER:
            return self.pool.buffers[st.buffer_index][: st.numel]
        assert st.buffer_index is not None
        if st.request is not None:
            start = time.perf_counter()
            try:
                self.bytes_read += st.request.wait()
            except OSError:
                self.pool.free.append(st.to_failed())
                raise
            finally:
                self.wait_s["read"] += time.perf_counter() - start
        st.to_in_buffer()
        return self.pool.buffers[st.buffer_index][: st.numel]

    def swap_out(self, st: SwappedTensor) -> None:
        """Start writing ``st``'s buffer to its file; the buffer stays busy until `wait_out`."""
        with ranges.range("offload.swap_out"):
            assert st.buffer_index is not None
            try:
                req = self.io.submit_write(self._padded(st.buffer_index, st.numel), st.path)
            except OSError:  # the file is not current; the buffer is free again
                self.pool.free.append(st.to_discarded())
                raise
            st.to_swapping_out(req)
            self._writing.append(st)

    def wait_out(self, st: SwappedTensor) -> None:
        """Finish ``st``'s swap-out and free its buffer."""
        if st.state != SwapState.SWAPPING_OUT:
            return
        assert st.request is not None
        start = time.perf_counter()
        try:
            nbytes = st.request.wait()
        except OSError:  # raised once: the file is not current, the buffer is free again
            self._writing.remove(st)
            self.pool.free.append(st.to_failed())
            raise
        finally:
            self.wait_s["write"] += time.perf_counter() - start
        self.bytes_written += nbytes
        self._writing.remove(st)
        self.pool.free.append(st.to_on_disk())

    def write(self, st: SwappedTensor, values: torch.Tensor) -> None:
        """Start writing ``values`` (``st.numel`` elements) to ``st``'s file through a pool buffer,
        without reading the file first (a tensor overwritten whole, e.g. a parameter shard)."""
        index = self._acquire()
        self.pool.buffers[index][: st.numel].copy_(values.reshape(-1))
        st.to_filled(index)
        self.swap_out(st)

    def release(self, st: SwappedTensor) -> None:
        """Free ``st``'s buffer without writing it back: only for a buffer that was read and not
        changed since (its file is current)."""
        self.pool.free.append(st.to_discarded())

    def wait_all(self) -> None:
        """Finish every swap-out in flight; raises the first failure after waiting for all."""
        first: OSError | None = None
        while self._writing:
            try:
                self.wait_out(self._writing[0])
            except OSError as err:
                first = first or err
        if first is not None:
            raise first

    def abandon(self) -> None:
        """After a failure part-way through a pipeline: wait for every request in flight
        (ignoring their errors) and free every buffer, leaving each tensor ON_DISK or NEW."""
        for st in self.tensors.values():
            if st.state is SwapState.SWAPPING_IN:
                if st.request is not None:
                    with contextlib.suppress(OSError):
                        st.request.wait()
                self.pool.free.append(st.to_failed())
            elif st.state is SwapState.IN_BUFFER:
                self.release(st)
        with contextlib.suppress(OSError):
            self.wait_all()

    def close(self) -> None:
        """Wait for writes in flight, then delete the swap files."""
        try:
            self.wait_all()
        finally:
            self.dir.close()


def check_free_space(swappers: list[TensorSwapper]) -> None:
    """Refuse swap files that cannot fit, before they are written (a full disk mid-training
    costs the run; at set-up it costs nothing). Per file system: the bytes every registered
    tensor's file will take (4 KiB-padded) minus what its file holds already, against the free
    space ``shutil.disk_usage`` reports. Raises ``OSError(ENOSPC)`` naming the keys, the
    directory, both numbers and the fix. Costs one ``stat`` per swap file."""
    need: dict[int, tuple[Path, int, list[str]]] = {}
    for sw in swappers:
        itemsize = torch.empty((), dtype=sw.dtype).element_size()
        more = 0
        for st in sw.tensors.values():
            size = -(-st.numel * itemsize // ALIGN) * ALIGN
            try:
                size -= st.path.stat().st_size
            except FileNotFoundError:
                pass
            more += max(size, 0)
        dev = os.stat(sw.dir.path).st_dev
        path, total, keys = need.get(dev, (sw.dir.path.parent, 0, []))
        need[dev] = (path, total + more, [*keys, sw.key])
    for path, total, keys in need.values():
        free = shutil.disk_usage(path).free
        if total > free:
            names = " and ".join(f"{k}.nvme_path" for k in dict.fromkeys(keys))
            raise OSError(
                errno.ENOSPC,
                f"{names}={str(path)!r}: the swap files need {total} more bytes and the file "
                f"system has {free} free: free space there, point nvme_path at a larger disk, "
                f"or offload less (device 'cpu')",
                str(path),
            )


class SwapCounters:
    """`bytes_read` / `bytes_written` of an object's ``swapper`` (a `TensorSwapper`), for the
    classes that do their file I/O through one (`SwappedGrads`, `NvmeShards`)."""

    swapper: TensorSwapper

    @property
    def bytes_read(self) -> int:
        return self.swapper.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.swapper.bytes_written
