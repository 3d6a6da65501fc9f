"""fp32 <-> bf16 casts (round-to-nearest-even) and fused flatten/unflatten, compiled or reference.

The functions here have the signatures of `minispeed.core.ops.cast_reference` (re-exported as
`cast.reference`) and give the same bits. Each call dispatches on the tensor's device:

- CPU: the C++ op (`csrc/cast/cast.cpp`: AVX-512 / AVX2 / scalar loops on OpenMP threads);
- CUDA: the CUDA op (`csrc/cast/cast_cuda.cu`);
- anything else, an op that cannot be built, or `MINISPEED_DISABLE_OPS=cast`: the reference,
  after one warning.

Costs per element: `float_to_bf16` reads 4 B, writes 2 B; `bf16_to_float` reads 2 B, writes
4 B; `flatten`/`unflatten` read numel * in_bytes and write numel * out_bytes. A non-contiguous
input is first made contiguous (one extra read and write of it). Not differentiable: these move
data (master weights, communication buffers) like `copy_` under `torch.no_grad()`.

Used by ZeRO's mixed precision (fp32 master -> bf16 params) and by communication compression.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from minispeed.core.accelerator import get_accelerator
from minispeed.core.op_builder import OpBuilder, OpLoader
from minispeed.core.ops import cast_reference as reference

__all__ = [
    "CastBuilder",
    "CastCudaBuilder",
    "bf16_to_float",
    "flatten",
    "float_to_bf16",
    "reference",
    "unflatten",
]

_CSRC = Path(__file__).resolve().parent.parent / "csrc"


class CastBuilder(OpBuilder):
    """The CPU cast op: one .cpp (pybind11 only, no torch headers: builds in seconds), SIMD + OpenMP."""

    name = "cast"
    csrc_root = _CSRC
    sources = ("cast/cast.cpp",)


class CastCudaBuilder(OpBuilder):
    """The CUDA cast op: plain-CUDA kernels plus a host-only torch binding (needs a GPU)."""

    name = "cast_cuda"
    csrc_root = _CSRC
    sources = ("cast/cast_cuda.cu", "cast/cast_cuda_binding.cpp")
    uses_simd = False
    uses_openmp = False


# Per SIMD level: MINISPEED_SIMD=scalar selects a build of its own (tests compare the paths).
_OPS = OpLoader({"cpu": CastBuilder(), "cuda": CastCudaBuilder()}, per_simd_level=True)

# Values of the C++ enum CopyKind in csrc/cast/cast.cpp.
_KIND_BYTES, _KIND_F32_TO_BF16, _KIND_BF16_TO_F32 = 0, 1, 2


def _op_for(device: torch.device) -> ModuleType | None:
    """The compiled op for `device`, or `None` to run the reference (warned once by the loader)."""
    return _OPS.load(device.type)


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the (contiguous) memory of `a` and `b` intersects."""
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a.numel() > 0 and b.numel() > 0 and a0 < b1 and b0 < a1


def _cast(src: torch.Tensor, out: torch.Tensor | None, to_bf16: bool) -> torch.Tensor:
    from_dtype, to_dtype = (
        (torch.float32, torch.bfloat16) if to_bf16 else (torch.bfloat16, torch.float32)
    )
    if src.dtype != from_dtype:
        fix = ".float()" if from_dtype == torch.float32 else ".bfloat16()"
        raise TypeError(f"src must be {from_dtype}, got {src.dtype}: call {fix} first")
    if out is not None:
        reference._check_out(out, src, to_dtype)
    op = _op_for(src.device)
    ref = reference.float_to_bf16 if to_bf16 else reference.bf16_to_float
    if op is None:
        return ref(src, out)
    src = src.detach().contiguous()
    target = out.detach() if out is not None else torch.empty_like(src, dtype=to_dtype)
    if not target.is_contiguous() or _overlaps(src, target):
        # See Note [raw pointers, no torch headers]: the kernel writes dst densely and in
        # parallel, so it needs its own dense buffer.
        target = torch.empty_like(src, dtype=to_dtype)
    kernel = op.float_to_bf16 if to_bf16 else op.bf16_to_float
    if src.device.type == "cuda":
        acc = get_accelerator()
        if src.device.index not in (None, acc.current_device_index()):
            raise ValueError(
                f"src is on {src.device} but the current device is "
                f"{acc.device()}: call get_accelerator().set_device({src.device.index}) first"
            )
        stream = acc.current_stream().cuda_stream  # launch on the caller's stream
        kernel(src.data_ptr(), target.data_ptr(), src.numel(), stream)
    else:
        kernel(src.data_ptr(), target.data_ptr(), src.numel())
    if out is None:
        return target
    if target.data_ptr() != out.data_ptr() or not out.is_contiguous():
        out.copy_(target)
    return out


def float_to_bf16(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 -> bf16, round-to-nearest-even, NaN -> `0x7FC0`. Reads 4 B, writes 2 B per element.

    `out` (bf16, shape of `src`, same device) receives the result when given and is returned.
    """
    return _cast(src, out, to_bf16=True)


def bf16_to_float(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 -> fp32, exact. Reads 2 B, writes 4 B per element. `out` as in `float_to_bf16`."""
    return _cast(src, out, to_bf16=False)


def _segment_kind(src: torch.dtype, dst: torch.dtype) -> int | None:
    """The C++ CopyKind for a `src` -> `dst` copy, or `None` if the op cannot do it."""
    if src == dst:
        return _KIND_BYTES
    if (src, dst) == (torch.float32, torch.bfloat16):
        return _KIND_F32_TO_BF16
    if (src, dst) == (torch.bfloat16, torch.float32):
        return _KIND_BF16_TO_F32
    return None


def _copy_segments(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> bool:
    """Run every (src, dst) copy in one parallel C++ loop. Returns False where the op cannot.

    Each pair is two contiguous 1-D CPU tensors of equal numel that do not overlap each other.
    """
    kinds = [_segment_kind(s.dtype, d.dtype) for s, d in pairs]
    if any(k is None for k in kinds):
        return False  # the reference raises the clear error for an unsupported pair
    op = _op_for(torch.device("cpu"))
    if op is None:
        return False
    counts = [
        s.numel() * s.element_size() if k == _KIND_BYTES else s.numel()
        for (s, _), k in zip(pairs, kinds)
    ]
    op.copy_segments(
        [s.data_ptr() for s, _ in pairs], [d.data_ptr() for _, d in pairs], counts, kinds
    )
    return True


def flatten(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    offsets: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Copy `tensors` into one 1-D buffer at `offsets` in one parallel pass, casting fp32<->bf16.

    Same contract as `minispeed.core.ops.cast_reference.flatten`: `out` defaults to a zeroed
    buffer of `dtype` (default: the first tensor's) packing the tensors back to back. Reads
    sum(numel * in_bytes), writes sum(numel * out_bytes); gaps between slots are untouched.
    """
    offsets = list(offsets) if offsets is not None else reference.default_offsets(tensors)
    if out is None:
        end = max((o + t.numel() for t, o in zip(tensors, offsets)), default=0)
        dt = dtype or (tensors[0].dtype if tensors else torch.float32)
        device = tensors[0].device if tensors else None
        out = torch.zeros(end, dtype=dt, device=device)
    reference.check_layout(tensors, out, offsets)
    if out.device.type == "cpu" and out.is_contiguous():
        sources = [t.detach().contiguous().view(-1) for t in tensors]
        slots = [out.detach()[o : o + t.numel()] for t, o in zip(sources, offsets)]
        if not any(_overlaps(s, out) for s in sources) and _copy_segments(
            list(zip(sources, slots))
        ):
            return out
    return reference.flatten(tensors, out, offsets)


def unflatten(
    flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Copy `flat[offset : offset + numel]` back into each tensor in place, casting fp32<->bf16.

    The inverse of `flatten`; same contract as the reference's `unflatten`. Non-contiguous
    targets are written through a staging copy (one extra write of them). Returns `tensors`.
    """
    offsets = list(offsets) if offsets is not None else reference.default_offsets(tensors)
    reference.check_layout(tensors, flat, offsets)
    if flat.device.type == "cpu" and flat.is_contiguous():
        # Contiguous targets are written in place; others through a dense staging tensor.
        targets = [
            t.detach() if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype)
            for t in tensors
        ]
        slots = [flat.detach()[o : o + t.numel()] for t, o in zip(targets, offsets)]
        pairs = [(s, t.view(-1)) for s, t in zip(slots, targets)]
        if not any(_overlaps(flat, t) for t in targets) and _copy_segments(pairs):
            for t, staged in zip(tensors, targets):
                if not t.is_contiguous():
                    t.detach().copy_(staged)
            return list(tensors)
    return reference.unflatten(flat, tensors, offsets)
