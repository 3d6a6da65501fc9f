"""The op's build: SIMD levels compiled in, OpenMP linked, the AVX-512 path compiles."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from minispeed.core.op_builder import SimdLevel, requested_simd_level, simd_flags
from minispeed.core.op_builder.toolchain import cxx_compiler
from minispeed.offload.ops import OffloadBuilder, load_op

CSRC = Path(OffloadBuilder.csrc_root)


def test_every_simd_level_up_to_the_build_is_compiled_in() -> None:
    op = load_op()
    if op is None:
        pytest.skip("the offload op cannot be built here (no compiler): the reference runs")
    assert list(op.simd_levels()) == list(range(int(requested_simd_level()) + 1))


def test_openmp_is_linked_and_uses_torch_threads() -> None:
    op = load_op()
    if op is None:
        pytest.skip("the offload op cannot be built here")
    # The .so links libgomp (the one torch loaded), so omp threads follow torch.set_num_threads.
    assert op.max_threads() == torch.get_num_threads()


@pytest.mark.parametrize("level", [SimdLevel.AVX512, SimdLevel.AVX2, SimdLevel.SCALAR])
def test_kernel_source_compiles_at_every_simd_level(level: SimdLevel, tmp_path: Path) -> None:
    """Compiled to an object file (no torch/pybind headers: seconds), so AVX-512 is checked on any
    CPU; a full compile, not -fsyntax-only, because intrinsics are checked against the target
    flags only when they are inlined."""
    cxx = cxx_compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = CSRC / "cpu_optim" / "cpu_optim.cpp"
    out = tmp_path / f"cpu_optim_{level.label}.o"
    includes = [f"-I{d}" for d in OffloadBuilder().include_paths()]  # core's minispeed/simd.h too
    cmd = [cxx, "-std=c++17", "-O2", "-c", "-fopenmp", *simd_flags(level), *includes, str(src)]
    cmd += ["-o", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.stat().st_size > 0


def test_the_optimizer_asks_its_builder_once_not_on_every_step(monkeypatch) -> None:
    # Asking a builder costs ~0.3 ms (flags fingerprinted, compiler found): once per process.
    from minispeed.core.op_builder import OpLoader
    from minispeed.offload import CPUAdam, ops

    asked = []
    real_load = OffloadBuilder.load
    monkeypatch.setattr(OffloadBuilder, "load", lambda self: asked.append(1) or real_load(self))
    monkeypatch.setattr(ops, "_OPS", OpLoader(ops._OPS.builders, per_simd_level=True))
    p = torch.nn.Parameter(torch.randn(32))
    opt = CPUAdam([p], lr=1e-3)
    for _ in range(3):
        p.grad = torch.randn(32)
        opt.step()
    assert len(asked) <= 1  # 0 where the op cannot be built: the reference runs
