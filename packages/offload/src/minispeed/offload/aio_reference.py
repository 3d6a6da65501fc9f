"""Pure-Python async I/O engine: the C++ ``AioEngine``'s contract on a ``ThreadPoolExecutor``.

Same methods as the compiled engine (``submit``, ``wait``, ``pending``, ``threads``) and the same
results (``(bytes, err, message)``, ``err`` an errno or `SHORT_READ`); used when the op cannot
be built, and by the tests as the specification. ``os.pread``/``os.pwrite`` release the GIL, so
the threads overlap their I/O as the C++ workers do, at a Python call per block.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["SHORT_READ", "ReferenceEngine", "io_busy_seconds"]

#: err of a read that reached the end of the file first (the C++ kShortRead code).
SHORT_READ = -1


class _BusyClock:
    """Note [the I/O busy clock] in csrc/aio/aio.h, for this module's engines: seconds with at
    least one request in flight (here from open to its last block; the reference's fsync runs in
    ``wait``, outside the clock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._busy_s = 0.0

    def begin(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1

    def end(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._busy_s += time.perf_counter() - self._since

    def seconds(self) -> float:
        with self._lock:
            open_s = time.perf_counter() - self._since if self._in_flight else 0.0
            return self._busy_s + open_s


_CLOCK = _BusyClock()


def io_busy_seconds() -> float:
    """Seconds with at least one reference-engine request in flight, in this process."""
    return _CLOCK.seconds()


class ReferenceEngine:
    """Thread-pool I/O in Python: ``threads`` workers, requests cut into ``block_bytes`` blocks."""

    def __init__(self, threads: int, block_bytes: int, single_submit: bool) -> None:
        self.threads = max(1, threads)
        self._block = max(4096, block_bytes)
        self._single = single_submit
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="minispeed-aio")
        self._lock = threading.Lock()
        self._requests: dict[int, tuple[int, list[Future], int, bool]] = {}
        self._next = 1

    def submit(
        self,
        path: str,
        buffer: memoryview,
        nbytes: int,
        offset: int,
        write: bool,
        direct: bool,
        fsync_after: bool,
    ) -> int:
        """Queue the request; ``buffer`` is a writable byte memoryview of ``nbytes``."""
        with self._lock:
            rid, self._next = self._next, self._next + 1
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        if direct:
            flags |= os.O_DIRECT
        try:
            fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
        except OSError as err:
            self._requests[rid] = (-1, [], err.errno or errno.EIO, False)
            return rid
        step = nbytes if self._single else self._block
        _CLOCK.begin()
        futures = [
            self._pool.submit(self._run, fd, buffer[b : b + step], offset + b, write)
            for b in range(0, nbytes, step)
        ]
        self._requests[rid] = (fd, futures, 0, fsync_after)
        left = [len(futures)]  # blocks still running; the last one ends the request's clock

        def block_done(_: Future) -> None:
            with self._lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                _CLOCK.end()

        for f in futures:
            f.add_done_callback(block_done)
        if not futures:
            _CLOCK.end()
        return rid

    def _run(self, fd: int, view: memoryview, at: int, write: bool) -> tuple[int, int, str]:
        done = 0
        while done < len(view):
            chunk = view[done : done + self._block]
            try:
                n = os.pwrite(fd, chunk, at + done) if write else os.preadv(fd, [chunk], at + done)
            except OSError as err:
                return (
                    done,
                    err.errno or errno.EIO,
                    f"{'pwrite' if write else 'pread'}: {err.strerror}",
                )
            if n == 0:
                if write:
                    return done, errno.ENOSPC, "pwrite wrote 0 bytes"
                size = os.fstat(fd).st_size
                return done, SHORT_READ, f"short read: the file has {size} bytes"
            done += n
        return done, 0, ""

    def wait(self, rid: int) -> tuple[int, int, str]:
        """Block until request ``rid`` completes; ``(bytes, err, message)``."""
        entry = self._requests.pop(rid, None)
        if entry is None:
            return 0, errno.EINVAL, f"unknown request id {rid} (already waited on?)"
        fd, futures, open_err, fsync_after = entry
        if fd < 0:
            return 0, open_err, f"open: {os.strerror(open_err)}"
        total, err, message = 0, 0, ""
        for f in futures:
            n, e, m = f.result()
            total += n
            if e and not err:
                err, message = e, m
        try:
            if not err and fsync_after:
                os.fsync(fd)
        finally:
            os.close(fd)
        return total, err, message

    def pending(self) -> int:
        """Requests submitted and not yet waited on."""
        return len(self._requests)
