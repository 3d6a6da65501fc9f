"""Where the build tools are: the C++ compiler, ninja, nvcc, and the GPUs' compute capabilities.

Every lookup answers `None` (or an empty list) instead of raising, so `OpBuilder` can turn
a missing tool into an `is_compatible() -> (False, "why")` answer and the report can print it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from minispeed.core.accelerator import get_accelerator

__all__ = [
    "cuda_device_arches",
    "cxx_compiler",
    "find_ninja",
    "find_nvcc",
    "nvcc_version",
    "tool_version",
]


def cxx_compiler() -> str | None:
    """Absolute path of the C++ compiler torch's JIT will call (`$CXX`, else `c++`)."""
    return shutil.which(os.environ.get("CXX", "c++"))


def find_ninja() -> str | None:
    """Absolute path of `ninja`: on `PATH`, else beside this Python (a venv's `bin/`).

    A venv's `bin/` is not on `PATH` when Python is called by its full path
    (`.venv/bin/python -m ...`), yet `pip install ninja` put the binary there.
    """
    found = shutil.which("ninja")
    if found:
        return found
    beside = Path(sys.executable).parent / "ninja"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def find_nvcc() -> str | None:
    """Absolute path of `nvcc`: on `PATH`, else `$CUDA_HOME/bin/nvcc` (or `/usr/local/cuda`)."""
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


@functools.cache
def tool_version(path: str) -> str | None:
    """The first line of `<path> --version` that names a version (cached per path)."""
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    for line in lines:
        if re.search(r"release \d+\.\d+|\d+\.\d+\.\d+", line):
            return line
    return lines[0] if lines else None


def nvcc_version() -> str | None:
    """`"13.0"` style release of the nvcc found by `find_nvcc`, or `None`."""
    nvcc = find_nvcc()
    line = tool_version(nvcc) if nvcc else None
    match = re.search(r"release (\d+\.\d+)", line or "")
    return match.group(1) if match else None


def cuda_device_arches() -> list[str]:
    """Compute capabilities of the visible GPUs as `"8.0"` strings, sorted; empty without a GPU.

    Asks `get_accelerator` first, so `MINISPEED_ACCELERATOR=cpu` hides the GPUs here too.
    """
    acc = get_accelerator()
    if acc.name != "cuda":
        return []
    import torch

    caps = {torch.cuda.get_device_capability(i) for i in range(acc.device_count())}
    return [f"{major}.{minor}" for major, minor in sorted(caps)]
