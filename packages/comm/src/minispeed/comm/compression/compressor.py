"""What every compressor offers, and how a packed tensor becomes bytes on the wire.

A *compressor* maps an fp32 vector `x` (n elements) to a *packed* form that is smaller on the
wire, and back: `x_hat = decompress(compress(x))`. Three are provided:

- `OnebitCompressor`: sign bits and one fp32 scale per chunk,
  `ceil(n / 8) + 4 ceil(n / chunk)` bytes (about 32x fewer than fp32);
- `TopkCompressor`: k fp32 values and k int32 indices, `8 k` bytes;
- `BlockQuantizer`: int8/int4 codes and one fp32 scale per block,
  `ceil(n bits / 8) + 4 ceil(n / block)` bytes.

The first and the last pack alike, as `ScaledCodes` (codes of 1, 4 or 8 bits and one fp32 scale
per group of elements); top-k as `TopkPacked`. (`wire` holds these formulas as functions.) Each
is a *contraction*: for some δ in (0, 1],
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

import dataclasses
from typing import Protocol, runtime_checkable

import torch

__all__ = ["Compressor", "Packed", "ScaledCodes", "as_bytes", "bytes_as", "code_bytes"]


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


def code_bytes(numel: int, code_bits: int) -> int:
    """Bytes of `numel` codes of `code_bits` bits each, packed: `ceil(numel · code_bits / 8)`."""
    return -(-numel * code_bits // 8)


@dataclasses.dataclass(frozen=True)
class ScaledCodes:
    """`numel` elements as `code_bits`-bit codes (uint8, packed) and one fp32 scale per
    `group_numel` of them: the packed form of sign compression (`OnebitCompressor`: 1 bit, the
    group a chunk) and of block quantization (`BlockQuantizer`: 8 or 4 bits, the group a block).
    Travels as Note [packed bytes layout] says: the scales' bytes, then the codes.
    """

    scales: torch.Tensor  # fp32 [ceil(numel / group_numel)]
    codes: torch.Tensor  # uint8 [code_bytes(numel, code_bits)]; the codec's bit order
    numel: int
    code_bits: int
    group_numel: int

    @staticmethod
    def nbytes_for(numel: int, code_bits: int, group_numel: int) -> int:
        """`code_bytes(numel, code_bits) + 4 ceil(numel / group_numel)`: one message's bytes."""
        return code_bytes(numel, code_bits) + 4 * -(-numel // group_numel)

    @property
    def nbytes(self) -> int:
        """`4 * len(scales) + len(codes)`."""
        return 4 * self.scales.numel() + self.codes.numel()

    def to_bytes(self) -> torch.Tensor:
        """One message: the scales' bytes, then the codes."""
        return self.to_rows(1).view(-1)

    def to_rows(self, n: int) -> torch.Tensor:
        """`(n, bytes_per_row)` uint8: one message per consecutive `numel / n` elements.

        Rows must not share a byte or a scale: for `n > 1` each row's codes fill whole bytes and
        its length is a multiple of `group_numel` (pad each row to whole groups first).
        """
        row = self.numel // n if n else 0
        shared = row * self.code_bits % 8 or row % self.group_numel
        if n < 1 or row * n != self.numel or (n > 1 and shared):
            raise ValueError(
                f"cannot split {self.numel} elements of {self.code_bits}-bit codes (one scale per "
                f"{self.group_numel}) into {n} rows: each row needs whole bytes and whole scale "
                f"groups; pad each row to a multiple of {self.group_numel} first"
            )
        return torch.cat([as_bytes(self.scales).view(n, -1), self.codes.view(n, -1)], dim=1)

    @classmethod
    def from_rows(
        cls, rows: torch.Tensor, row_numel: int, code_bits: int, group_numel: int
    ) -> ScaledCodes:
        """Inverse of `to_rows`: `rows` is `(n, bytes_per_row)` uint8, `row_numel` elements each."""
        scale_bytes = 4 * -(-row_numel // group_numel)
        expected = scale_bytes + code_bytes(row_numel, code_bits)
        if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] != expected:
            raise ValueError(
                f"expected (n, {expected}) uint8 rows for {row_numel} elements of {code_bits}-bit "
                f"codes per row with one scale per {group_numel}, got {tuple(rows.shape)} "
                f"{rows.dtype}"
            )
        scales = bytes_as(rows[:, :scale_bytes].reshape(-1), torch.float32)
        codes = rows[:, scale_bytes:].reshape(-1)
        return cls(scales, codes, rows.shape[0] * row_numel, code_bits, group_numel)
