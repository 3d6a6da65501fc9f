"""`minispeed/simd.h` at every SIMD level: vector forms give the scalar forms' bits, which match torch.

`simd_header_probe.cpp` is compiled as a plain program (no torch or pybind11 headers: about a
second) with the op builder's flags for each level. Levels this CPU runs are executed: each vector
conversion must agree lane for lane with the scalar one (the program checks), and the scalar
fp32 -> bf16 / fp16 conversions must equal torch's on the same 65536 bit patterns. Levels the CPU
lacks (AVX-512 here) are compiled to an object, which checks the intrinsics against the flags.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from minispeed.core.op_builder import SHARED_INCLUDE_DIR, SimdLevel, simd_flags
from minispeed.core.op_builder.simd import missing_cpu_flags
from minispeed.core.op_builder.toolchain import cxx_compiler

PROBE = Path(__file__).with_name("simd_header_probe.cpp")
CXX = cxx_compiler()

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(CXX is None, reason="no C++ compiler"),
]


def _compile(level: SimdLevel, out: Path, *extra: str) -> None:
    cmd = [str(CXX), "-std=c++17", "-O2", *simd_flags(level), f"-I{SHARED_INCLUDE_DIR}"]
    cmd += [*extra, str(PROBE), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("level", list(SimdLevel), ids=lambda level: level.label)
def test_vector_conversions_match_scalar_and_torch(level: SimdLevel, tmp_path: Path):
    if missing_cpu_flags(level):
        _compile(level, tmp_path / "probe.o", "-c")
        pytest.skip(
            f"compiled only: this CPU lacks {missing_cpu_flags(level)} to run {level.label}"
        )
    exe, data = tmp_path / "probe", tmp_path / "out.bin"
    _compile(level, exe)
    proc = subprocess.run([str(exe), str(data)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    name, lanes = proc.stdout.split()
    assert name == level.label
    assert (
        int(lanes) == {SimdLevel.SCALAR: 0, SimdLevel.AVX2: 1, SimdLevel.AVX512: 2}[level] * 65536
    )

    raw = data.read_bytes()
    n = len(raw) // 8
    x = torch.from_numpy(np.frombuffer(raw[: 4 * n], dtype=np.int32).copy()).view(torch.float32)
    bf = torch.from_numpy(np.frombuffer(raw[4 * n : 6 * n], dtype=np.int16).copy())
    hf = torch.from_numpy(np.frombuffer(raw[6 * n :], dtype=np.int16).copy())
    nan = torch.isnan(x)
    assert nan.any() and torch.isinf(x).any(), "the probe's inputs must include the specials"
    want_bf = x.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(bf[~nan], want_bf[~nan]), "f32_to_bf16_rne differs from torch"
    assert (bf[nan] == 0x7FC0).all(), "every NaN must become the canonical quiet NaN 0x7FC0"
    want_hf = x.to(torch.float16).view(torch.int16)
    assert torch.equal(hf[~nan], want_hf[~nan]), "f32_to_fp16_rne differs from torch"
    assert torch.isnan(hf.view(torch.float16)[nan]).all()
