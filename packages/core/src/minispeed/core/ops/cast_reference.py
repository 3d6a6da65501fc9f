"""The pure-PyTorch reference of `minispeed.core.ops.cast`: the specification and the fallback.

Written on the integer bits so every step of the rounding is visible and matches the C++ op bit
for bit (see Note [bf16 round-to-nearest-even] in `csrc/include/minispeed/simd.h`). Slow on
purpose: it makes int64 temporaries (8 B per element each) for clarity.

Functions are not differentiable: they act on the data (master weights, communication buffers),
as `Tensor.copy_` under `torch.no_grad()` would.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

__all__ = ["bf16_to_float", "flatten", "float_to_bf16", "unflatten"]

_QUIET_NAN_BF16 = 0x7FC0


def _check_out(out: torch.Tensor, src: torch.Tensor, dtype: torch.dtype) -> None:
    if out.dtype != dtype:
        raise TypeError(f"out must be {dtype}, got {out.dtype}: allocate it with dtype={dtype}")
    if out.shape != src.shape:
        raise ValueError(
            f"out has shape {tuple(out.shape)} but src {tuple(src.shape)}: they must match"
        )
    if out.device != src.device:
        raise ValueError(f"out is on {out.device} but src on {src.device}: put both on one device")


def float_to_bf16(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 -> bf16 with round-to-nearest-even; every NaN becomes the quiet NaN `0x7FC0`.

    Reads 4 B and writes 2 B per element (plus the reference's temporaries). Returns `out`
    (shape of `src`) when given, else a new tensor.
    """
    if src.dtype != torch.float32:
        raise TypeError(f"src must be float32, got {src.dtype}: call .float() first")
    if out is not None:
        _check_out(out, src, torch.bfloat16)
    src = src.detach()
    bits = src.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # unsigned fp32 bits
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16  # in [0, 0xFFFF]
    rounded = torch.where(torch.isnan(src.contiguous()), _QUIET_NAN_BF16, rounded)
    signed16 = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded).to(torch.int16)
    result = signed16.view(torch.bfloat16)
    if out is None:
        return result
    return out.copy_(result)


def bf16_to_float(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 -> fp32, exact (the bf16 bits become the high half of the fp32).

    Reads 2 B and writes 4 B per element. Returns `out` when given, else a new tensor.
    """
    if src.dtype != torch.bfloat16:
        raise TypeError(f"src must be bfloat16, got {src.dtype}: call .bfloat16() first")
    if out is not None:
        _check_out(out, src, torch.float32)
    # Sign extension fills the high 16 bits, which the shift pushes out: low16 << 16 remains.
    bits = src.detach().contiguous().view(torch.int16).to(torch.int32) << 16
    result = bits.view(torch.float32)
    if out is None:
        return result
    return out.copy_(result)


def _copy_cast(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[:] = src, with fp32 <-> bf16 through the RNE functions above (1-D, same numel)."""
    if src.dtype == dst.dtype:
        dst.copy_(src)
    elif src.dtype == torch.float32 and dst.dtype == torch.bfloat16:
        dst.copy_(float_to_bf16(src))
    elif src.dtype == torch.bfloat16 and dst.dtype == torch.float32:
        dst.copy_(bf16_to_float(src))
    else:
        raise TypeError(
            f"flatten/unflatten convert only float32 <-> bfloat16 or copy one dtype, got "
            f"{src.dtype} -> {dst.dtype}: cast the tensors first"
        )


def default_offsets(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Offsets that pack `tensors` back to back: `[0, n0, n0 + n1, ...]`."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += t.numel()
    return offsets


def check_layout(
    tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]
) -> None:
    """Raise unless every tensor's slot `[offset, offset + numel)` lies in `flat` without overlap."""
    if flat.dim() != 1:
        raise ValueError(f"flat must be 1-D, got shape {tuple(flat.shape)}: pass flat.view(-1)")
    if len(offsets) != len(tensors):
        raise ValueError(
            f"got {len(tensors)} tensors but {len(offsets)} offsets: give one offset each"
        )
    slots = sorted(
        (int(o), int(o) + t.numel(), k) for k, (t, o) in enumerate(zip(tensors, offsets))
    )
    for start, end, k in slots:
        if start < 0 or end > flat.numel():
            raise ValueError(
                f"tensor {k} needs flat[{start}:{end}] but flat has {flat.numel()} elements: "
                "enlarge flat or fix the offsets"
            )
    for (_, end_a, a), (start_b, _, b) in itertools.pairwise(slots):
        if start_b < end_a:
            raise ValueError(
                f"tensors {a} and {b} overlap in flat: offsets must give disjoint slots"
            )
    for k, t in enumerate(tensors):
        if t.device != flat.device:
            raise ValueError(
                f"tensor {k} is on {t.device} but flat on {flat.device}: use one device"
            )


def flatten(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    offsets: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Copy `tensors` into one 1-D buffer at `offsets` (default: back to back), casting to its dtype.

    `out` is the buffer; when omitted a zeroed one of `sum(numel)` elements and `dtype`
    (default: the first tensor's dtype) is allocated. Reads sum(numel * in_bytes) and writes
    sum(numel * out_bytes); the gaps between slots are left untouched.
    """
    offsets = list(offsets) if offsets is not None else default_offsets(tensors)
    if out is None:
        end = max((o + t.numel() for t, o in zip(tensors, offsets)), default=0)
        dt = dtype or (tensors[0].dtype if tensors else torch.float32)
        device = tensors[0].device if tensors else None
        out = torch.zeros(end, dtype=dt, device=device)
    check_layout(tensors, out, offsets)
    for t, o in zip(tensors, offsets):
        _copy_cast(t.detach().reshape(-1), out[o : o + t.numel()])
    return out


def unflatten(
    flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int] | None = None
) -> list[torch.Tensor]:
    """Copy `flat[offset : offset + numel]` back into each of `tensors` (in place), casting.

    The inverse of `flatten`. Reads sum(numel * flat_bytes), writes sum(numel * tensor_bytes).
    Returns `tensors` as a list.
    """
    offsets = list(offsets) if offsets is not None else default_offsets(tensors)
    check_layout(tensors, flat, offsets)
    for t, o in zip(tensors, offsets):
        if t.is_contiguous():
            _copy_cast(flat[o : o + t.numel()], t.detach().view(-1))
        else:
            staged = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
            _copy_cast(flat[o : o + t.numel()], staged)
            t.detach().copy_(staged.view(t.shape))
    return list(tensors)
