"""What every compressor offers, and how a packed tensor becomes bytes on the wire.

A *compressor* maps an fp32 vector `x` (n elements) to a *packed* form that is smaller on the
wire, and back: `x_hat = decompress(compress(x))`. Three are provided:

- `OnebitCompressor`: sign bits and one fp32 scale per chunk,
  `ceil(n / 8) + 4 ceil(n / chunk)` bytes (about 32x fewer than fp32);
- `TopkCompressor`: k fp32 values and k int32 indices, `8 k` bytes;
- `BlockQuantizer`: int8/int4 codes and one fp32 scale per block,
  `ceil(n bits / 8) + 4 ceil(n / block)` bytes.

(`wire` holds these formulas as functions.) Each is a *contraction*: for some δ in (0, 1],
`||x - x_hat||² <= (1 - δ) ||x||²`, which is what lets `ErrorFeedback`
keep the accumulated error bounded (see that module).

**Note [packed bytes layout]**

A packed tensor travels as one uint8 tensor, so a collective sends one message and the comms
logger counts exactly the compressed bytes. Float parts come first (scales, or top-k values),
byte parts after, so the floats of a message that starts on a 4-byte boundary can be viewed
in place. Several messages for several ranks are the *rows* of a `(n, bytes_per_row)`
tensor: `to_rows(n)` splits a packed vector of `n * row_numel` elements into one message
per row (rows must not share a byte or a scale), and `from_rows` reads them back as one
packed vector, so n received messages decompress in one kernel call.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["Compressor", "Packed", "as_bytes", "bytes_as"]


@runtime_checkable
class Packed(Protocol):
    """A compressed vector: knows its element count and how to become one uint8 message."""

    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes of `to_bytes` (what one rank puts in a message)."""
        ...

    def to_bytes(self) -> torch.Tensor:
        """The packed form as one contiguous uint8 tensor (see Note [packed bytes layout])."""
        ...


@runtime_checkable
class Compressor(Protocol):
    """Compress an fp32 vector to a `Packed` form and back (lossy)."""

    def compress(self, x: torch.Tensor) -> Packed:
        """Packed form of `x` (flattened; cast to fp32 if needed)."""
        ...

    def decompress(self, packed: Packed) -> torch.Tensor:
        """fp32 `[packed.numel]`: the compressor's estimate of the original vector."""
        ...

    def packed_nbytes(self, numel: int) -> int:
        """Bytes of the packed form of a vector of `numel` elements."""
        ...


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor as a 1-D uint8 view (no copy)."""
    return t.contiguous().view(-1).view(torch.uint8)


def bytes_as(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a contiguous 1-D uint8 slice as `dtype`.

    A view when the slice starts on a multiple of the element size (the common case, see
    Note [packed bytes layout]); otherwise a copy of just these bytes first.
    """
    size = torch.empty(0, dtype=dtype).element_size()
    if buf.numel() % size:
        raise ValueError(f"{buf.numel()} bytes do not hold a whole number of {dtype} values")
    if not buf.is_contiguous() or buf.storage_offset() % size:
        buf = buf.clone()
    return buf.view(dtype)
