"""Async I/O throughput: minispeed's AsyncIO vs ``dd`` with direct I/O on the same file system.

Run: ``.venv/bin/python benchmarks/offload_aio.py [--dir /tmp] [--gib 1] [--blocks 256K,1M,4M]
[--depths 1,4,16] [--repeats 2]``

Writes then reads ``--gib`` GiB of tensors (one 4 KiB-aligned buffer of 64 MiB reused for each
file chunk, so the numbers measure the disk, not memory allocation) at every block size x queue
depth, with O_DIRECT where the file system allows it (``direct_io_supported``); then ``dd
oflag=direct`` / ``iflag=direct`` at each block size moves the same bytes: the disk's own rate at
queue depth 1, the baseline. Reads follow writes of the same file; O_DIRECT reads bypass the page
cache, so they come from the disk (on a virtual machine the host may still cache it: a single
pass can read at several times the disk's rate). Every measurement is repeated ``--repeats``
times, dd and the engine alternating, and the best of each is reported. The file is deleted at
the end.
"""

from __future__ import annotations

import argparse
import os
import re
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


def _aio(path: Path, total: int, block: int, depth: int) -> tuple[float, float]:
    io = AsyncIO(AioConfig(block_bytes=block, queue_depth=depth), direct=None)
    buf = AsyncIO.aligned_empty(CHUNK // 4)
    buf.uniform_()
    start = time.perf_counter()
    for off in range(0, total, CHUNK):
        io.submit_write(buf, path, off)
    io.wait_all()
    os.sync()
    write = total / (time.perf_counter() - start)
    start = time.perf_counter()
    reqs = []
    for off in range(0, total, CHUNK):  # several chunks in flight: the engine's queue stays full
        reqs.append(io.submit_read(buf, path, off))
    io.wait_all()
    read = total / (time.perf_counter() - start)
    return write, read


def _dd(path: Path, total: int, block: int) -> tuple[float, float]:
    count = total // block

    def rate(args: list[str]) -> float:
        out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
        seconds = float(re.search(r"copied, ([\d.]+) s", out).group(1))
        return total / seconds

    write = rate(["if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", "oflag=direct",
                  "conv=fsync"])  # fmt: skip
    read = rate([f"if={path}", "of=/dev/null", f"bs={block}", f"count={count}", "iflag=direct"])
    return write, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--blocks", default="256K,1M,4M")
    parser.add_argument("--depths", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    total = int(args.gib * (1 << 30)) // CHUNK * CHUNK
    directory = Path(args.dir)
    path = directory / f"minispeed-aio-bench-{os.getpid()}.bin"
    console = Console(width=150)
    console.print(
        f"{total / 2**30:.2f} GiB in {directory} (O_DIRECT: {direct_io_supported(directory)}), "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    table = Table("block", "dd write MB/s", "dd read MB/s", "queue depth", "aio write MB/s",
                  "aio read MB/s", "write / dd", "read / dd")  # fmt: skip
    try:
        for btext in args.blocks.split(","):
            block = _size(btext)
            depths = [int(d) for d in args.depths.split(",")]
            dd_w = dd_r = 0.0
            best = {d: (0.0, 0.0) for d in depths}
            for _ in range(args.repeats):
                w, r = _dd(path, total, block)
                dd_w, dd_r = max(dd_w, w), max(dd_r, r)
                for depth in depths:
                    w, r = _aio(path, total, block, depth)
                    best[depth] = (max(best[depth][0], w), max(best[depth][1], r))
            for depth in depths:
                w, r = best[depth]
                table.add_row(
                    btext, f"{dd_w / 1e6:.0f}", f"{dd_r / 1e6:.0f}", str(depth), f"{w / 1e6:.0f}",
                    f"{r / 1e6:.0f}", f"{w / dd_w:.2f}", f"{r / dd_r:.2f}",
                )  # fmt: skip
        console.print(table)
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
