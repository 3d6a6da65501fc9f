"""Start N local processes the way torchrun does (RANK, WORLD_SIZE, MASTER_ADDR, ...) and wait.

Used by the `trace` and `calibrate` commands; the processes set up their own process group
(`minispeed.comm.init_distributed()` reads these variables), so the profiler itself never
touches torch.distributed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence

__all__ = ["launch"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    argv: Sequence[str], nproc: int, env: Mapping[str, str] | None = None, timeout_s: float = 300
) -> None:
    """Run `argv` as `nproc` ranks; raise naming the failed rank (and stop the others) if one
    fails, or all of them after `timeout_s`."""
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    port = str(_free_port())
    procs = []
    for rank in range(nproc):
        rank_env = dict(os.environ, **(env or {}))
        rank_env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )  # fmt: skip
        procs.append(subprocess.Popen(list(argv), env=rank_env))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed:
                raise RuntimeError(
                    f"rank {failed[0]} of {' '.join(argv)} exited with {procs[failed[0]].returncode}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{' '.join(argv)} did not finish within {timeout_s:.0f} s")
            time.sleep(0.05)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            raise RuntimeError(
                f"rank {failed[0]} of {' '.join(argv)} exited with {procs[failed[0]].returncode}"
            )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
