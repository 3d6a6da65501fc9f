"""DeepSpeed's `init_distributed` and `add_config_arguments`: the process group from torchrun's
environment, and the `--deepspeed` / `--deepspeed_config` flags.

Shared by `initialize` (step 2 of the composition, docs/architecture.md) and DeepSpeed's
`deepspeed.comm.init_distributed` (the `comm.py` adapter), so the adapter imports this module,
never the engine's face.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import minispeed.comm

__all__ = ["add_config_arguments", "init_distributed"]


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    verbose: bool = True,
    timeout: Any = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Start the default process group (DeepSpeed's signature): from torchrun's environment,
    or from an explicit rendezvous (`init_method="file://..."` or `"tcp://..."` with `rank`
    and `world_size`, as torch's `init_process_group` takes them).

    `dist_backend=None` picks the accelerator's (gloo on CPU, nccl on GPU); without torchrun's
    variables or an explicit rank a single-process group starts. MPI discovery is not used.
    """
    if distributed_port is not None and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(distributed_port)
    if timeout is None:
        timeout_s = 300.0
    elif hasattr(timeout, "total_seconds"):  # DeepSpeed passes a datetime.timedelta
        timeout_s = timeout.total_seconds()
    else:
        timeout_s = float(timeout)
    minispeed.comm.init_distributed(
        backend=dist_backend,
        timeout_s=timeout_s,
        init_method=init_method,
        rank=None if rank == -1 else rank,
        world_size=None if world_size == -1 else world_size,
    )


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed` and `--deepspeed_config` flags to `parser`."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (minispeed)"
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="ds_config.json path")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
