"""The end of every `scripts/record_ds_*.py` run: each rank's result joined into one fixture.

Each rank writes its result beside the fixture, rank 0 joins them after a barrier, writes the
fixture atomically (temporary file, fsync, rename) with the versions and the command that
recorded it, and removes the parts and the run's scratch folder. The recording scripts call
`record` (`write_fixture` over DeepSpeed's process group) from their `__main__` block only: the tests execute the same scripts under
another module name (`tests/engine/ds_scripts.py`), so this never runs there, and the scripts'
bodies stay plain DeepSpeed code. `FIXTURE_OUT` in the environment writes elsewhere (to compare
a new recording with the kept one). Importing this module refuses a `deepspeed` that is
minispeed under DeepSpeed's name (`require_deepspeed`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def require_deepspeed() -> str:
    """DeepSpeed's version, once checked to be DeepSpeed's own.

    A `deepspeed` whose version carries `+minispeed` is minispeed under DeepSpeed's name
    (packages/deepspeed_compat): a fixture recorded with it would compare minispeed with itself
    and pass whatever minispeed does. Every recorder calls this first (importing this module
    does), so recording in a venv that holds it fails before anything runs."""
    import deepspeed

    version = deepspeed.__version__
    if "+minispeed" in version:
        raise RuntimeError(
            f"this `deepspeed` is minispeed ({version}, packages/deepspeed_compat), not DeepSpeed: "
            "record fixtures with DeepSpeed's own venv (env -u PYTHONPATH DS_ACCELERATOR=cpu "
            "/work/dsvenv/bin/python ...), never with the one holding deepspeed_compat"
        )
    return version


def write_json(result: Any, fixture: Path, indent: int | None = 1) -> None:
    """`result` as JSON at `fixture` (or `$FIXTURE_OUT`): a temporary file, fsync, rename, so a
    fixture is never half-written. For a recorder of one process (no process group)."""
    out = Path(os.environ.get("FIXTURE_OUT", fixture))
    tmp = out.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(result, indent=indent))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def write_fixture(
    result: Any,
    fixture: Path,
    *,
    rank: int,
    world: int,
    barrier: Callable[[], Any],
    versions: dict[str, str],
    scratch: Path | None = None,
) -> None:
    """Join every rank's `result` into `fixture` (or `$FIXTURE_OUT`) as `{**versions, "command":
    ..., "ranks": [...]}`; collective (every rank calls it)."""
    out = Path(os.environ.get("FIXTURE_OUT", fixture))

    def part(r: int) -> Path:
        return out.with_suffix(f".rank{r}.json")

    part(rank).write_text(json.dumps(result))
    barrier()
    if rank != 0:
        return
    ranks = [json.loads(part(r).read_text()) for r in range(world)]
    command = (
        "env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run "
        f"--nproc_per_node {world} scripts/{Path(sys.argv[0]).name}"
    )
    write_json({**versions, "command": command, "ranks": ranks}, out)
    for r in range(world):
        part(r).unlink()
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


def record(result: Any, fixture: Path, *, scratch: Path | None = None) -> None:
    """`write_fixture` over DeepSpeed's process group (initialized by the script), recording
    DeepSpeed's and torch's versions; collective."""
    import torch
    import torch.distributed as dist

    write_fixture(
        result,
        fixture,
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        barrier=dist.barrier,
        versions={"deepspeed": require_deepspeed(), "torch": torch.__version__},
        scratch=scratch,
    )


require_deepspeed()  # importing this module in a recorder checks first (see the function)
