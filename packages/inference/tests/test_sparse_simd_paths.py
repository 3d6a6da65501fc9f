"""The sparse attention op's scalar and AVX2 builds (MINISPEED_SIMD=scalar / avx2) equal the
reference, values and gradients; its AVX-512 path compiles where the CPU cannot run it.

These builds are the same inference_kernels variants test_kernels_simd_paths.py builds (one
cached build per level serves both files).
"""

from __future__ import annotations

import subprocess
import sysconfig

import pybind11
import pytest
import torch

from minispeed.core.op_builder import SIMD_ENV, SimdLevel, cpu_simd_level, simd_flags
from minispeed.core.op_builder.toolchain import cxx_compiler
from minispeed.inference import kernels
from minispeed.inference.kernels import InferenceKernelsBuilder
from minispeed.inference.sparse import (
    BigBirdSparsityConfig,
    block_sparse_attention,
    sparse_attention_reference,
)

pytestmark = pytest.mark.timeout(400)


@pytest.mark.parametrize("level", ["scalar", "avx2"])
@pytest.mark.parametrize(("seq", "dim", "block"), [(40, 13, 8), (128, 40, 32)])
def test_lower_simd_levels_match_reference(monkeypatch, rel_close, level, seq, dim, block):
    """Each level below the CPU's widest (the widest runs in test_sparse_attention_numerics.py);
    the second shape fills AVX2's widest register tiles (4 vectors of 8) and their edges."""
    monkeypatch.setenv(SIMD_ENV, level)
    ok, why = InferenceKernelsBuilder().is_compatible()
    if not ok:
        pytest.skip(f"inference_kernels cannot be built at {level} here: {why}")
    if cpu_simd_level() == SimdLevel[level.upper()]:
        pytest.skip(
            f"{level} is this CPU's widest level: test_sparse_attention_numerics.py runs it"
        )
    op = kernels.load_op()
    if op is None:
        pytest.skip(f"the {level} build failed; see python -m minispeed.core.report")
    assert op.simd_level() == level
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, seq, dim, generator=gen, requires_grad=True) for _ in range(3))
    for attention in ("bidirectional", "unidirectional"):
        cfg = BigBirdSparsityConfig(3, block=block, num_random_blocks=1, attention=attention)
        layout = cfg.make_layout(seq)
        got = block_sparse_attention(q, k, v, layout, block, causal=cfg.causal)
        assert "BlockSparseAttention" in type(got.grad_fn).__name__
        want = sparse_attention_reference(q, k, v, layout, block, causal=cfg.causal)
        rel_close(got, want)
        dout = torch.randn(got.shape, generator=gen)
        for a, b in zip(
            torch.autograd.grad(got, (q, k, v), dout),
            torch.autograd.grad(want, (q, k, v), dout),
            strict=True,
        ):
            rel_close(a, b)


def test_avx512_path_compiles():
    if cpu_simd_level() == SimdLevel.AVX512:
        pytest.skip("this CPU runs AVX-512: test_sparse_attention_numerics.py runs it for real")
    cxx = cxx_compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    builder = InferenceKernelsBuilder()
    source = next(p for p in builder.source_paths() if p.name == "sparse_attention.cpp")
    cmd = [
        str(cxx), "-fsyntax-only", "-std=c++17", "-fopenmp", *simd_flags(SimdLevel.AVX512),
        f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
        *(f"-I{d}" for d in builder.include_paths()), str(source),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
