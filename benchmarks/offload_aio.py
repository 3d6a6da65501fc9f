"""Async I/O throughput: minispeed's AsyncIO against ``dd`` with O_DIRECT, in interleaved rounds.

Run: ``.venv/bin/python benchmarks/offload_aio.py [--dir /tmp] [--gib 1] [--blocks 1M,4M]
[--depths 1,8] [--rounds 5] [--buffers huge,4k] [--loop]``

Per block size, every round runs each contender once, in an order reversed every other round
(so drift in the machine's load or the virtual disk's cache favours no one):

- reads of one ``--gib`` GiB file of random bytes (written once, before the rounds): ``dd
  if=FILE of=/dev/null bs=B iflag=direct`` against the engine at each queue depth, reading the
  file in 64 MiB tensors. Both bypass the page cache (O_DIRECT), and the file's cached pages are
  dropped before every read (``posix_fadvise(DONTNEED)``) so neither side can meet a cached copy;
- writes of ``--gib`` GiB over a second, existing file: ``dd if=/dev/zero of=FILE bs=B
  oflag=direct conv=notrunc,fsync`` against the engine writing a 64 MiB tensor of random bytes
  over and over, then ``fsync`` of that file (no system-wide ``sync``, which would also flush
  other jobs' dirty pages into our time).

``--buffers``: ``huge`` is the engine's own buffer (`AsyncIO.aligned_empty`, on transparent huge
pages: Note [I/O buffers on huge pages] in aio.py); ``4k`` the same bytes from ``torch.empty``
(4 KiB pages), the buffer this benchmark used before. ``--loop`` adds, for reads, a plain
single-threaded ``pread`` loop (dd's loop, in Python, no engine) into each buffer. The table gives each contender's median
MB/s, its spread (min-max over the rounds) and its ratio to ``dd`` at the same block size: the
ratio of the medians, and the median of the per-round ratios (each round's pair ran back to
back). The load average is printed at the start and the end. The files are deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from minispeed.offload import AioConfig, AsyncIO, direct_io_supported

_UNITS = {"K": 1 << 10, "M": 1 << 20}
CHUNK = 64 << 20  # bytes per submitted tensor


def _size(text: str) -> int:
    return int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _buffer(kind: str) -> torch.Tensor:
    """64 MiB of random bytes: the engine's buffer (huge pages) or torch's (4 KiB pages)."""
    if kind == "huge":
        buf = AsyncIO.aligned_empty(CHUNK // 4)
    else:
        raw = torch.empty(CHUNK + 4096, dtype=torch.uint8)
        start = (-raw.data_ptr()) % 4096
        buf = raw[start : start + CHUNK].view(torch.float32)
    return buf.uniform_()


def _dd(args: list[str], total: int) -> float:
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    return total / float(re.search(r"copied, ([\d.]+) s", out).group(1))


def _aio(io: AsyncIO, buf: torch.Tensor, path: Path, total: int, write: bool) -> float:
    if not write:
        _drop_cache(path)
    start = time.perf_counter()
    for off in range(0, total, CHUNK):  # every chunk in flight: the engine's queue stays full
        (io.submit_write if write else io.submit_read)(buf, path, off)
    io.wait_all()
    if write:
        _fsync(path)
    return total / (time.perf_counter() - start)


def _pread_loop(buf: torch.Tensor, path: Path, total: int, block: int) -> float:
    """One thread, one O_DIRECT ``pread`` of ``block`` bytes at a time into ``buf`` (dd's loop,
    without the engine): separates what the engine costs from what the buffer's pages cost."""
    _drop_cache(path)
    view = memoryview(buf.view(torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        start = time.perf_counter()
        for off in range(0, total, block):
            at = off % CHUNK
            os.preadv(fd, [view[at : at + block]], off)
        return total / (time.perf_counter() - start)
    finally:
        os.close(fd)


def _contenders(
    src: Path, dst: Path, total: int, block: int, engines: dict[int, AsyncIO],
    buffers: dict[str, torch.Tensor], loop: bool,
) -> dict[tuple[str, str], object]:  # fmt: skip
    """(op, name) -> a call returning bytes/s, for one block size."""
    count = total // block

    def dd_read() -> float:
        _drop_cache(src)
        return _dd([f"if={src}", "of=/dev/null", f"bs={block}", f"count={count}", "iflag=direct"],
                   total)  # fmt: skip

    def dd_write() -> float:
        return _dd(["if=/dev/zero", f"of={dst}", f"bs={block}", f"count={count}", "oflag=direct",
                    "conv=notrunc,fsync"], total)  # fmt: skip

    def aio(op: str, depth: int, kind: str):
        path = src if op == "read" else dst
        return lambda: _aio(engines[depth], buffers[kind], path, total, write=op == "write")

    out: dict[tuple[str, str], object] = {("read", "dd"): dd_read, ("write", "dd"): dd_write}
    for kind in buffers if loop else ():
        out[("read", f"pread loop, {kind} pages")] = lambda kind=kind: _pread_loop(
            buffers[kind], src, total, block
        )
    for op in ("read", "write"):
        for depth in engines:
            for kind in buffers:
                out[(op, f"aio depth {depth}, {kind} pages")] = aio(op, depth, kind)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--blocks", default="1M,4M")
    parser.add_argument("--depths", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--buffers", default="huge,4k", help="huge (the engine's), 4k, or both")
    parser.add_argument(
        "--loop", action="store_true", help="also a plain pread loop (no engine) per buffer kind"
    )
    args = parser.parse_args()
    total = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    directory = Path(args.dir)
    src = directory / f"minispeed-aio-bench-{os.getpid()}-read.bin"
    dst = directory / f"minispeed-aio-bench-{os.getpid()}-write.bin"
    console = Console(width=160)
    console.print(
        f"{total / 2**30:.2f} GiB in {directory} (O_DIRECT: {direct_io_supported(directory)}), "
        f"{args.rounds} interleaved rounds, load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs"
    )
    kinds = args.buffers.split(",")
    buffers = {k: _buffer(k) for k in kinds}
    depths = [int(d) for d in args.depths.split(",")]
    table = Table("block", "op", "contender", "median MB/s", "min-max MB/s", "median / dd",
                  "per-round ratio, median (min-max)")  # fmt: skip
    try:
        setup = AsyncIO(AioConfig(block_bytes=1 << 20, queue_depth=8), direct=True)
        for path in (src, dst):  # both files exist at full size before any round
            _aio(setup, buffers[kinds[0]], path, total, write=True)
        for btext in args.blocks.split(","):
            block = _size(btext)
            engines = {d: AsyncIO(AioConfig(block_bytes=block, queue_depth=d), direct=True)
                       for d in depths}  # fmt: skip
            contenders = _contenders(src, dst, total, block, engines, buffers, args.loop)
            rates: dict[tuple[str, str], list[float]] = {key: [] for key in contenders}
            order = list(contenders)
            for r in range(args.rounds):
                for key in order if r % 2 == 0 else order[::-1]:
                    rates[key].append(contenders[key]())
            for (op, name), got in sorted(rates.items(), key=lambda kv: kv[0][0] == "write"):
                dd = rates[(op, "dd")]
                med = statistics.median(got)
                paired = [g / b for g, b in zip(got, dd, strict=True)]
                table.add_row(
                    btext, op, name, f"{med / 1e6:.0f}",
                    f"{min(got) / 1e6:.0f}-{max(got) / 1e6:.0f}",
                    f"{med / statistics.median(dd):.2f}",
                    "-" if name == "dd" else
                    f"{statistics.median(paired):.2f} ({min(paired):.2f}-{max(paired):.2f})",
                )  # fmt: skip
        console.print(table)
        console.print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
