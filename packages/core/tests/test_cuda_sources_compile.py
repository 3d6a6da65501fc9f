"""Every CUDA source of every installed minispeed package compiles with nvcc for sm_80 and sm_90.

CUDA ops only run where a GPU is present, but their sources must not rot on machines without
one: this compiles each ``.cu`` to an object (no linking, no GPU needed). The sources come from
the op registry (every builder's ``.cu`` sources) and from globbing
``packages/*/src/minispeed/*/csrc/**/*.cu`` in this repository, so a ``.cu`` file no builder lists
yet is checked too. Skipped, with the reason, where nvcc is absent.
"""

from __future__ import annotations

import re
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from minispeed.core.op_builder import SHARED_INCLUDE_DIR, discover_builders
from minispeed.core.op_builder.toolchain import find_nvcc

REPO = Path(__file__).resolve().parents[3]
ARCHES = ("sm_80", "sm_90")
NVCC = find_nvcc()
_USES_TORCH = re.compile(r'#\s*include\s*[<"](torch|ATen|c10)/')
_USES_PYBIND = re.compile(r'#\s*include\s*[<"](pybind11|torch)/')

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH or in $CUDA_HOME/bin"),
]


def _cuda_sources() -> dict[Path, list[Path]]:
    """Each .cu file -> include directories to compile it with."""
    found: dict[Path, list[Path]] = {}
    for cls in discover_builders().builders.values():
        try:
            builder = cls()
        except TypeError:
            continue  # a mis-declared builder is reported by the registry tests and the report
        for path in builder.source_paths():
            if path.suffix == ".cu" and path.is_file():
                found[path.resolve()] = builder.include_paths()
    for path in sorted(REPO.glob("packages/*/src/minispeed/*/csrc/**/*.cu")):
        found.setdefault(path.resolve(), [path.parent, SHARED_INCLUDE_DIR])
    return dict(sorted(found.items()))


CUDA_SOURCES = _cuda_sources()


def _short(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _nvcc_command(source: Path, includes: list[Path], arch: str, obj: Path) -> list[str]:
    cmd = [str(NVCC), "-c", f"-arch={arch}", "-std=c++17", "-O2", "-o", str(obj), str(source)]
    cmd += [f"-I{d}" for d in includes]
    text = source.read_text()
    if _USES_TORCH.search(text):
        from torch.utils.cpp_extension import include_paths

        cmd += [f"-I{d}" for d in include_paths()]
    if _USES_PYBIND.search(text):
        cmd.append(f"-I{sysconfig.get_paths()['include']}")
    return cmd


def test_core_cast_kernel_is_found():
    names = {p.name for p in CUDA_SOURCES}
    assert "cast_cuda.cu" in names, f"discovery missed core's CUDA cast; found {sorted(names)}"


@pytest.mark.parametrize("source", list(CUDA_SOURCES), ids=[_short(p) for p in CUDA_SOURCES])
def test_cuda_source_compiles_for_sm80_and_sm90(source: Path, tmp_path: Path):
    def compile_for(arch: str) -> tuple[str, subprocess.CompletedProcess, Path]:
        obj = tmp_path / f"{source.stem}.{arch}.o"
        cmd = _nvcc_command(source, CUDA_SOURCES[source], arch, obj)
        return arch, subprocess.run(cmd, capture_output=True, text=True, timeout=280), obj

    with ThreadPoolExecutor(max_workers=len(ARCHES)) as pool:
        results = list(pool.map(compile_for, ARCHES))
    failures = [
        f"{arch}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        for arch, proc, _ in results
        if proc.returncode != 0
    ]
    assert not failures, f"nvcc failed on {_short(source)}:\n" + "\n".join(failures)
    for arch, _, obj in results:
        data = obj.read_bytes()
        assert arch.encode() in data, f"{obj.name} holds no {arch} code"
