"""The compression kernels, compiled or reference: builders, and wrappers that pick one per call.

The functions here have the signatures of `reference` (re-exported as `ops.reference`)
and give the same bytes. Each call dispatches on the tensor's device:

- CPU: the C++ op (`csrc/compression/*.cpp`; AVX-512, AVX2 and scalar paths, the widest this
  build and CPU allow; single-threaded, so each rank of a job keeps to its own core);
- CUDA: the CUDA op (`csrc/compression/compression_cuda.cu`); top-k selection has no kernel and
  runs the reference there (`torch.topk` on the GPU);
- an op that cannot be built, or `MINISPEED_DISABLE_OPS=comm_compression`: the reference,
  after one warning (`minispeed.core.op_builder.load_or_fallback`).

All kernels live in ONE extension so a machine compiles them once (about 45 s of CPU, 2-4 minutes
on a busy 2-core machine), then loads the cached `.so`. Inputs of any shape are flattened;
bf16/fp16 inputs are cast to fp32 first (one extra read and write of `4 n` bytes), since the
scales and the wire formats are defined on fp32.

Costs per element (n elements): `sign_pack` reads 4 B and writes 1/8 B (+4 B per chunk);
`sign_unpack` the reverse; `quantize_blocks` reads 4 B twice (absmax, then quantize) and
writes `bits/8` B; `topk_select` reads 4 B three times and keeps a 4 B scratch copy.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from minispeed.comm.compression import reference
from minispeed.comm.compression.compressor import code_bytes
from minispeed.core.accelerator import get_accelerator
from minispeed.core.op_builder import OpBuilder, OpLoader

__all__ = [
    "CompressionBuilder",
    "CompressionCudaBuilder",
    "dequantize_blocks",
    "load_op",
    "quantize_blocks",
    "reference",
    "sign_pack",
    "sign_unpack",
    "sparse_accumulate_",
    "topk_select",
]

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_CPU_SOURCES = (
    "compression/bindings.cpp",
    "compression/sign_cpu.cpp",
    "compression/quantize_cpu.cpp",
    "compression/topk_cpu.cpp",
)


class CompressionBuilder(OpBuilder):
    """The CPU op: sign bits, block quantization, top-k; AVX-512/AVX2/scalar paths in one build.

    Only `bindings.cpp` includes torch, so the three kernel files compile in seconds; the torch
    headers of the binding dominate the first build.
    """

    name = "comm_compression"
    csrc_root = _CSRC
    sources = _CPU_SOURCES
    uses_openmp = False  # one thread per rank: see the module docstring


class CompressionCudaBuilder(OpBuilder):
    """The CUDA op: the CPU sources plus `compression_cuda.cu`, with CUDA dispatch compiled in."""

    name = "comm_compression_cuda"
    csrc_root = _CSRC
    sources = (*_CPU_SOURCES, "compression/compression_cuda.cu")
    uses_openmp = False
    extra_cxx_flags = ("-DMINISPEED_WITH_CUDA",)
    extra_nvcc_flags = ("-DMINISPEED_WITH_CUDA",)


_OPS = OpLoader({"cpu": CompressionBuilder(), "cuda": CompressionCudaBuilder()})


def load_op(device_type: str = "cpu") -> ModuleType | None:
    """The compiled op for `device_type` (`"cpu"` / `"cuda"`), or `None` for the reference.

    Loaded once per process (the SIMD level in force at the first call wins);
    `MINISPEED_DISABLE_OPS` is still read on every call. The module's functions take an
    explicit SIMD level (`op.simd_levels()` lists those compiled in: 0 scalar, 1 AVX2,
    2 AVX-512); tests use it to compare every path with the reference.
    """
    return _OPS.load(device_type)


def _packed(
    codes: torch.Tensor,
    name: str,
    nbytes: int,
    scales: torch.Tensor,
    numel: int,
    per_scale: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed message of `numel` elements, checked: `codes` uint8 of `nbytes` bytes and
    one scale per `per_scale` elements; returned flat and contiguous (scales as fp32)."""
    if codes.dtype != torch.uint8 or codes.numel() != nbytes:
        raise ValueError(
            f"{name} must be uint8 with {nbytes} bytes for numel={numel}, got "
            f"{codes.dtype} with {codes.numel()}"
        )
    if scales.numel() != -(-numel // per_scale):
        raise ValueError(
            f"scales must hold one value per {per_scale} elements, ceil({numel} / {per_scale}) "
            f"= {-(-numel // per_scale)}, got {scales.numel()}"
        )
    return codes.reshape(-1).contiguous(), _flat_fp32(scales, "scales")


def _flat_fp32(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    """`x` as a contiguous 1-D fp32 tensor (a copy only when needed)."""
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def _check_positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _best(op: ModuleType) -> int:
    return op.simd_levels()[-1]


def _stream(t: torch.Tensor) -> dict[str, int]:
    """`{"stream": handle}` of the current CUDA stream for a CUDA tensor; `{}` on the CPU.

    The kernels launch on the current device, so a CUDA tensor must live there.
    """
    if t.device.type != "cuda":
        return {}
    acc = get_accelerator()
    if t.device.index is not None and t.device.index != acc.current_device_index():
        raise ValueError(
            f"tensor on {t.device} but the current device is {acc.current_device_index()}: call "
            "get_accelerator().set_device(...) for this rank's GPU first"
        )
    return {"stream": acc.current_stream().cuda_stream}


# -- 1-bit sign compression ------------------------------------------------------------------
def sign_pack(x: torch.Tensor, chunk_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign bits (uint8 `[ceil(n/8)]`) and per-chunk mean `|x|` (fp32 `[ceil(n/chunk)]`)."""
    _check_positive(chunk_numel, "chunk_numel")
    x = _flat_fp32(x)
    op = load_op(x.device.type)
    if op is None:
        return reference.sign_pack(x, chunk_numel)
    bits, scales = op.sign_pack(x, chunk_numel, _best(op), **_stream(x))
    return bits, scales


def sign_unpack(
    bits: torch.Tensor, scales: torch.Tensor, chunk_numel: int, numel: int
) -> torch.Tensor:
    """fp32 `[numel]`: `-scale` where a bit is set, `+scale` elsewhere."""
    _check_positive(chunk_numel, "chunk_numel")
    bits, scales = _packed(bits, "bits", code_bytes(numel, 1), scales, numel, chunk_numel)
    op = load_op(bits.device.type)
    if op is None:
        return reference.sign_unpack(bits, scales, chunk_numel, numel)
    return op.sign_unpack(bits, scales, chunk_numel, numel, _best(op), **_stream(bits))


# -- block quantization ---------------------------------------------------------------------
def _check_quant(block_numel: int, bits: int) -> None:
    _check_positive(block_numel, "block_numel")
    reference.qmax_for_bits(bits)
    if bits == 4 and block_numel % 2:
        raise ValueError(
            f"int4 packs two elements per byte, so block_numel must be even; got {block_numel}"
        )


def quantize_blocks(
    x: torch.Tensor, block_numel: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absmax int8/int4 quantization per block: `(q uint8, scales fp32)` (see `reference`)."""
    _check_quant(block_numel, bits)
    x = _flat_fp32(x)
    op = load_op(x.device.type)
    if op is None:
        return reference.quantize_blocks(x, block_numel, bits)
    q, scales = op.quantize_blocks(x, block_numel, bits, _best(op), **_stream(x))
    return q, scales


def dequantize_blocks(
    q: torch.Tensor, scales: torch.Tensor, block_numel: int, bits: int, numel: int
) -> torch.Tensor:
    """fp32 `[numel]` = `q * scale` of its block."""
    _check_quant(block_numel, bits)
    q, scales = _packed(q, "q", code_bytes(numel, bits), scales, numel, block_numel)
    op = load_op(q.device.type)
    if op is None:
        return reference.dequantize_blocks(q, scales, block_numel, bits, numel)
    return op.dequantize_blocks(q, scales, block_numel, bits, numel, _best(op), **_stream(q))


# -- top-k sparsification ----------------------------------------------------------------------
def topk_select(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values fp32 [k], indices int32 [k] ascending)` of the k largest `|x|`; ties: lower index."""
    x = _flat_fp32(x)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= x.numel():
        raise ValueError(f"k must be an int in [0, numel={x.numel()}], got {k!r}")
    if x.numel() >= 2**31:
        raise ValueError("top-k indices are int32: compress tensors of fewer than 2^31 elements")
    op = load_op("cpu") if x.device.type == "cpu" else None  # no CUDA selection kernel
    if op is None:
        return reference.topk_select(x, k)
    try:
        values, indices = op.topk_select(x, k, _best(op))
    except RuntimeError as err:  # the op's NaN check: same type of error as the reference's
        raise ValueError(str(err).splitlines()[0]) from err
    return values, indices


def sparse_accumulate_(
    out: torch.Tensor, values: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """`out[indices[j]] += values[j]` in place; `out` must be contiguous fp32. Returns `out`."""
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise TypeError(f"out must be a contiguous fp32 tensor, got {out.dtype}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32 (as topk_select returns), got {indices.dtype}")
    flat = out.view(-1)
    values = _flat_fp32(values, "values")
    op = load_op(out.device.type)
    if op is None:
        reference.sparse_accumulate_(flat, values, indices)
        return out
    if out.device.type != "cpu" and indices.numel():
        # The CUDA kernel skips out-of-range indices silently; refuse them here instead.
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= flat.numel():
            raise ValueError(
                f"indices fall outside [0, {flat.numel()}): they do not belong to this tensor"
            )
    try:
        op.sparse_accumulate_(flat, values, indices.reshape(-1).contiguous(), **_stream(flat))
    except RuntimeError as err:
        raise ValueError(str(err).splitlines()[0]) from err
    return out
