"""The scalar and AVX2 paths (MINISPEED_SIMD=scalar / avx2, one build each) equal the reference;
AVX-512 and the CUDA binding compile.

This machine's widest runnable level is covered by test_kernels_numerics.py. AVX-512 cannot run
on a CPU without it (SIGILL), so where it is missing we only check that the source compiles with
the AVX-512 flags (syntax and intrinsics, no code generation: about a second).
"""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
from pathlib import Path

import pybind11
import pytest
import torch

from minispeed.core.op_builder import SIMD_ENV, SimdLevel, cpu_simd_level, simd_flags
from minispeed.core.op_builder.toolchain import cxx_compiler
from minispeed.inference import kernels
from minispeed.inference.kernels import InferenceKernelsBuilder, reference
from minispeed.inference.quantize import quantize_per_channel

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(params=["scalar", "avx2"])
def lower_op(request, monkeypatch):
    """The op built for a level below this machine's widest (which test_kernels_numerics.py runs)."""
    monkeypatch.setenv(SIMD_ENV, request.param)
    ok, why = InferenceKernelsBuilder().is_compatible()
    if not ok:
        pytest.skip(f"inference_kernels cannot be built at {request.param} here: {why}")
    if cpu_simd_level() == SimdLevel[request.param.upper()]:
        pytest.skip(f"{request.param} is this CPU's widest level: test_kernels_numerics.py runs it")
    op = kernels.load_op()
    if op is None:
        pytest.skip(f"the {request.param} build failed; see python -m minispeed.core.report")
    assert op.simd_level() == request.param
    return op


def test_lower_simd_levels_match_reference(lower_op, rel_close):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 37, generator=g), torch.randn(5, 37, generator=g)
    w, b = torch.randn(37, generator=g), torch.randn(37, generator=g)
    rel_close(
        kernels.layer_norm(x, w, b, residual=r)[0], reference.layer_norm(x, w, b, residual=r)[0]
    )
    rel_close(kernels.rms_norm(x, w, residual=r)[0], reference.rms_norm(x, w, residual=r)[0])
    rel_close(kernels.bias_gelu(x, b), reference.bias_gelu(x, b))
    mask = torch.rand(5, 37, generator=g) > 0.5
    rel_close(kernels.masked_softmax(x, mask), reference.masked_softmax(x, mask))
    cos, sin = kernels.rotary_tables(9, 6)
    xr, pos = torch.randn(4, 3, 6, generator=g), torch.tensor([0, 8, 3, 3])
    rel_close(
        kernels.rotary_embedding(xr, pos, cos, sin), reference.rotary_embedding(xr, pos, cos, sin)
    )
    k, v = torch.randn(6, 4, 3, 19, generator=g), torch.randn(6, 4, 3, 19, generator=g)
    q, tables, lens = (
        torch.randn(2, 3, 19, generator=g),
        torch.tensor([[5, 0], [2, 3]]),
        torch.tensor([7, 3]),
    )
    rel_close(
        kernels.decode_attention(q, k, v, tables, lens),
        reference.decode_attention(q, k, v, tables, lens),
    )
    wq, s = quantize_per_channel(torch.randn(131, 37, generator=g))
    for rows in (1, 3, 8, 19):  # each register blocking, and a prefill's chunks of 8
        xs = torch.randn(rows, 37, generator=g)
        rel_close(kernels.int8_linear(xs, wq, s, None), reference.int8_linear(xs, wq, s, None))
    rel_close(kernels.bias_gelu(x, b, "tanh"), reference.bias_gelu(x, b, "tanh"))
    w, bl = torch.randn(41, 37, generator=g), torch.randn(41, generator=g)
    for weight in (w, w.t().contiguous().t()):  # nn.Linear's layout, then Conv1D's
        for rows in (1, 3, 8):
            xs = torch.randn(rows, 37, generator=g)
            rel_close(kernels.linear(xs, weight, bl), reference.linear(xs, weight, bl))
    up = torch.randn(41, 37, generator=g)
    for rows in (1, 3, 8):  # the SwiGLU pair, then grouped-query decode (3 heads over 1 cached)
        xs = torch.randn(rows, 37, generator=g)
        rel_close(kernels.swiglu(xs, w, up, bl), reference.swiglu(xs, w, up, bl))
    k1, v1 = k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
    rel_close(
        kernels.decode_attention(q, k1, v1, tables, lens),
        reference.decode_attention(q, k1, v1, tables, lens),
    )


def test_avx512_path_compiles():
    if cpu_simd_level() == SimdLevel.AVX512:
        pytest.skip("this CPU runs AVX-512: test_kernels_numerics.py runs that path for real")
    cxx = cxx_compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    builder = InferenceKernelsBuilder()
    source = builder.source_paths()[0]
    cmd = [
        str(cxx), "-fsyntax-only", "-std=c++17", "-fopenmp", *simd_flags(SimdLevel.AVX512),
        "-DTORCH_EXTENSION_NAME=probe", f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}", *(f"-I{d}" for d in builder.include_paths()),
        str(source),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_cuda_binding_compiles_and_binds_every_kernel():
    """The CUDA op's host binding (no GPU here: syntax only, against the CUDA headers); the .cu
    itself is compiled by core's test_cuda_sources_compile.py. It binds every kernel of the CPU op
    with the same arguments plus the stream."""
    from minispeed.core.op_builder.toolchain import find_nvcc
    from minispeed.inference.kernels import InferenceCudaKernelsBuilder

    binding = InferenceCudaKernelsBuilder().source_paths()[1]
    cpu_defs = set(
        re.findall(r'm\.def\("(\w+)"', InferenceKernelsBuilder().source_paths()[0].read_text())
    )
    cuda_defs = set(re.findall(r'm\.def\("(\w+)"', binding.read_text()))
    # CPU only: tanh GeLU, and the greedy argmax (torch's CUDA argmax is one fast kernel
    # already; kernels.argmax runs it on a GPU tensor)
    assert cuda_defs == cpu_defs - {"simd_level", "bias_gelu_tanh", "argmax_rows"}
    nvcc, cxx = find_nvcc(), cxx_compiler()
    if nvcc is None or cxx is None:
        pytest.skip("nvcc or a C++ compiler not found")
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             str(Path(nvcc).resolve().parent.parent)]  # fmt: skip
    found = [
        Path(h) / "include"
        for h in homes
        if h and (Path(h) / "include/cuda_runtime_api.h").is_file()
    ]
    if not found:
        pytest.skip(f"cuda_runtime_api.h not found under {homes}")
    cuda_include = found[0]
    cmd = [
        str(cxx), "-fsyntax-only", "-std=c++17", "-DTORCH_EXTENSION_NAME=probe",
        f"-I{binding.parent}", f"-I{cuda_include}", f"-I{pybind11.get_include()}",
        f"-I{sysconfig.get_paths()['include']}", str(binding),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
