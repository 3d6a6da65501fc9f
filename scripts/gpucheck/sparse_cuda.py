"""The block-sparse attention CUDA kernels, called directly (the package does not bind them yet).

`minispeed/inference/csrc/kernels/sparse_attention_cuda.cu` holds the forward and backward as
`extern "C"` launchers over raw pointers and a stream; `block_sparse_attention` on CUDA tensors
runs the dense PyTorch reference instead, because no binding exists in this cut (the package's
docstring says so; `check_attention` reports it as a finding). To prove the kernels themselves,
this module compiles the one `.cu` file into a shared library with nvcc for the GPU found and
calls the launchers through `ctypes`: no package code is changed, and nothing here is used
outside the GPU check.
"""

from __future__ import annotations

import ctypes
import subprocess
import time
from pathlib import Path
from typing import Any

from gpucheck.harness import REPO

SOURCE = REPO / "packages/inference/src/minispeed/inference/csrc/kernels/sparse_attention_cuda.cu"
_P, _I, _B, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_bool, ctypes.c_float


def build_library(scratch: Path, arch: str) -> tuple[Path, float]:
    """Compile `SOURCE` for `arch` (`"90"`: sm_90) into a shared library under `scratch`;
    returns its path and the seconds nvcc took (0 when an earlier build of this run is there)."""
    from minispeed.core.op_builder.toolchain import find_nvcc

    lib = scratch / f"libminispeed_sparse_attention_sm{arch}.so"
    if lib.is_file():
        return lib, 0.0
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH or in $CUDA_HOME/bin")
    tmp = lib.with_suffix(".tmp.so")
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", str(tmp), str(SOURCE)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    tmp.replace(lib)
    return lib, time.perf_counter() - t0


class SparseAttentionCuda:
    """The two launchers of the library, over torch tensors on the current CUDA device."""

    def __init__(self, lib: Path) -> None:
        self.lib = ctypes.CDLL(str(lib))
        self._fwd = self.lib.minispeed_sparse_attention_forward_cuda
        self._fwd.restype = ctypes.c_int
        self._fwd.argtypes = [_P] * 7 + [_I] * 5 + [_B, _F, _P]
        self._bwd = self.lib.minispeed_sparse_attention_backward_cuda
        self._bwd.restype = ctypes.c_int
        self._bwd.argtypes = [_P] * 11 + [_I] * 5 + [_B, _F, _P]

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} launch returned cudaError {code}")

    def forward(self, q, k, v, csr: Any, scale: float) -> tuple[Any, Any]:
        """`(out, lse)` for contiguous fp32 `q, k, v` `(B, H, T, D)` and a `BlockSparseLayout`
        whose `row_ptr` and `cols` are on the device (`device_csr`)."""
        import torch

        B, H, T, D = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        self._check(self._fwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), csr.row_ptr.data_ptr(),
                              csr.cols.data_ptr(), out.data_ptr(), lse.data_ptr(), B, H, T, D,
                              csr.block, csr.causal, scale, stream), "forward")  # fmt: skip
        return out, lse

    def backward(self, q, k, v, out, lse, dout, csr: Any, scale: float) -> tuple[Any, Any, Any]:
        """`(dq, dk, dv)`; dk and dv are accumulated with atomics, so they start zeroed."""
        import torch

        B, H, T, D = q.shape
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        stream = torch.cuda.current_stream(q.device).cuda_stream
        self._check(self._bwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                              dout.data_ptr(), lse.data_ptr(), csr.row_ptr.data_ptr(),
                              csr.cols.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                              B, H, T, D, csr.block, csr.causal, scale, stream), "backward")  # fmt: skip
        return dq, dk, dv


def device_csr(csr: Any, device: Any) -> Any:
    """`csr` (a `BlockSparseLayout`) with its `row_ptr` and `cols` on `device`."""
    import dataclasses

    return dataclasses.replace(csr, row_ptr=csr.row_ptr.to(device), cols=csr.cols.to(device))
