"""`python -m minispeed.core.report`: what this machine offers minispeed, and every op's status.

Prints two rich tables: the environment (Python, torch, CUDA runtime and nvcc, accelerator and GPU
archs, C++ compiler, ninja, communication backends, SIMD level, op cache) and one row per op
registered by any installed minispeed package (see `minispeed.core.op_builder.registry`):
compatible here, built (in the cache), and why not. Nothing is compiled: reading it costs a few
`--version` calls and hashing each op's sources.

`--build` additionally loads (building if needed) every compatible op, to warm the cache before
a job, e.g. once per node.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys

import torch
from rich.console import Console
from rich.table import Table

from minispeed.core.accelerator import get_accelerator
from minispeed.core.op_builder import (
    SIMD_ENV,
    OpBuildError,
    cpu_simd_level,
    discover_builders,
    op_cache_root,
    ops_disabled,
    requested_simd_level,
    toolchain,
)

__all__ = ["OpStatus", "environment", "main", "op_statuses"]


@dataclasses.dataclass(frozen=True)
class OpStatus:
    """One op's row: where it comes from, whether it can be built here, whether it is built."""

    name: str
    builder: str  # "module.Class" of the builder, or the failing entry point
    compatible: bool
    cached: bool
    reason: str  # why not compatible / disabled / why the entry point failed; "" when fine


def _comm_backends() -> str:
    # The report is the one core module allowed to ask torch.distributed (availability only).
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed unavailable"
    found = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    return ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in found.items())


def environment() -> dict[str, str]:
    """Rows of the environment table, as label -> value."""
    acc = get_accelerator()
    nvcc = toolchain.find_nvcc()
    cxx = toolchain.cxx_compiler()
    ninja = toolchain.find_ninja()
    arches = toolchain.cuda_device_arches()
    try:
        simd = requested_simd_level().label
    except ValueError as err:
        simd = f"invalid: {err}"
    return {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__,
        "torch CUDA runtime": str(torch.version.cuda or "none (CPU build)"),
        "nvcc": f"{nvcc} (release {toolchain.nvcc_version()})" if nvcc else "not found",
        "accelerator": f"{acc.name} x{acc.device_count()}",
        "GPU compute capability": ", ".join(arches) if arches else "no GPU",
        "C++ compiler": f"{cxx} ({toolchain.tool_version(cxx)})" if cxx else "not found",
        "ninja": f"{ninja} ({toolchain.tool_version(ninja)})" if ninja else "not found",
        "comm backends": _comm_backends(),
        "SIMD level": f"{simd} (CPU supports {cpu_simd_level().label}; override {SIMD_ENV})",
        "op cache": str(op_cache_root()),
    }


def op_statuses(build: bool = False) -> list[OpStatus]:
    """One `OpStatus` per registered op (`build=True` loads each compatible op first)."""
    registry = discover_builders()
    rows = []
    for name, cls in registry.builders.items():
        qualname = f"{cls.__module__}.{cls.__qualname__}"
        try:
            builder = cls()
            compatible, reason = builder.is_compatible()
            if ops_disabled(name):
                reason = "disabled by MINISPEED_DISABLE_OPS" + (f"; {reason}" if reason else "")
            if build and compatible and not ops_disabled(name):
                try:
                    builder.load()
                except OpBuildError as err:
                    reason = err.reason
            rows.append(OpStatus(name, qualname, compatible, builder.is_cached(), reason))
        except Exception as err:  # a broken builder must not hide the others
            rows.append(OpStatus(name, qualname, False, False, f"{type(err).__name__}: {err}"))
    for name, why in registry.errors.items():
        rows.append(OpStatus(name, "(entry point)", False, False, why))
    return sorted(rows, key=lambda r: r.name)


def render(console: Console, build: bool = False) -> None:
    """Print the environment and ops tables to `console`."""
    env = Table(title="minispeed environment", show_header=False)
    env.add_column("item", style="bold")
    env.add_column("value")
    for label, value in environment().items():
        env.add_row(label, value)
    console.print(env)

    ops = Table(title="minispeed ops")
    for column in ("op", "builder", "compatible", "built (cached)", "why not"):
        ops.add_column(column)
    for row in op_statuses(build=build):
        ops.add_row(
            row.name,
            row.builder,
            "[green]yes[/]" if row.compatible else "[red]no[/]",
            "[green]yes[/]" if row.cached else "no",
            row.reason,
        )
    console.print(ops)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m minispeed.core.report`."""
    parser = argparse.ArgumentParser(prog="python -m minispeed.core.report", description=__doc__)
    parser.add_argument("--build", action="store_true", help="build every compatible op now")
    args = parser.parse_args(argv)
    render(Console(width=max(Console().width, 140)), build=args.build)
    return 0


if __name__ == "__main__":
    sys.exit(main())
