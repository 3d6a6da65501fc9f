"""1-bit sign compression with one scale per chunk: the compressor behind 1-bit Adam.

A chunk `v` of `c` elements is sent as its signs and one number, `s = mean |v|`, and is
rebuilt as `Q(v) = s * sign(v)` (a sign bit of 1 means negative, see `reference`).

Why the mean of `|v|`: for a fixed sign pattern, `||v - s sign(v)||² = Σ (|v_i| - s)²` is
smallest at `s = mean |v|`. (1-bit Adam's paper uses the RMS, `||v||₂ / sqrt(c)`, which keeps
the norm but can make the error larger than `v` itself.)

Error bound (derivation). With `s = ||v||₁ / c`:

```text
||v - Q(v)||²  =  Σ |v_i|² - 2 s Σ |v_i| + c s²  =  ||v||₂² - ||v||₁² / c
              <=  (1 - 1/c) ||v||₂²                  because ||v||₁ >= ||v||₂
```

so per chunk, and summed over chunks for the whole vector, `||x - Q(x)||₂ <= sqrt(1 - 1/c)
||x||₂`: a contraction, the property error feedback needs (`error_feedback`). The bound is
reached only by a vector with one non-zero element per chunk; for Gaussian-like gradients the
ratio is about `sqrt(1 - 2/π) ≈ 0.60`.

Bytes: `ceil(n / 8)` of bits plus `4 ceil(n / c)` of fp32 scales; against fp32
(`4 n`) that is `32 / (1 + 32 / c)`-fold fewer, 31.5x at `c = 2048`.
"""

from __future__ import annotations

import dataclasses

import torch

from minispeed.comm.compression import ops
from minispeed.comm.compression.compressor import as_bytes, bytes_as

__all__ = ["OnebitCompressor", "SignPacked"]


@dataclasses.dataclass(frozen=True)
class SignPacked:
    """Signs and chunk scales of `numel` elements (see Note [packed bytes layout])."""

    scales: torch.Tensor  # fp32 [ceil(numel / chunk_numel)]
    bits: torch.Tensor  # uint8 [ceil(numel / 8)], element i in bit i % 8 of byte i // 8
    numel: int
    chunk_numel: int

    @property
    def nbytes(self) -> int:
        """`4 * len(scales) + len(bits)`."""
        return 4 * self.scales.numel() + self.bits.numel()

    def to_bytes(self) -> torch.Tensor:
        """One message: scales' bytes, then the bits."""
        return self.to_rows(1).view(-1)

    def to_rows(self, n: int) -> torch.Tensor:
        """`(n, bytes_per_row)` uint8: one message per consecutive `numel / n` elements.

        Rows must not share a byte or a scale: for `n > 1` the row length must be a multiple
        of 8 and of `chunk_numel`.
        """
        row = self.numel // n if n else 0
        if n < 1 or row * n != self.numel or (n > 1 and (row % 8 or row % self.chunk_numel)):
            raise ValueError(
                f"cannot split {self.numel} sign-compressed elements (chunk {self.chunk_numel}) "
                f"into {n} rows: each row needs a whole number of bytes and of chunks"
            )
        scale_bytes = as_bytes(self.scales).view(n, -1)  # (n, 4 * chunks per row)
        return torch.cat([scale_bytes, self.bits.view(n, -1)], dim=1)

    @classmethod
    def from_rows(cls, rows: torch.Tensor, row_numel: int, chunk_numel: int) -> SignPacked:
        """Inverse of `to_rows`: `rows` is `(n, bytes_per_row)` uint8."""
        n = rows.shape[0]
        scales_per_row = -(-row_numel // chunk_numel)
        expected = 4 * scales_per_row + -(-row_numel // 8)
        if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] != expected:
            raise ValueError(
                f"expected (n, {expected}) uint8 rows for {row_numel} elements per row with "
                f"chunk {chunk_numel}, got {tuple(rows.shape)} {rows.dtype}"
            )
        scales = bytes_as(rows[:, : 4 * scales_per_row].reshape(-1), torch.float32)
        bits = rows[:, 4 * scales_per_row :].reshape(-1)
        return cls(scales, bits, n * row_numel, chunk_numel)


@dataclasses.dataclass(frozen=True)
class OnebitCompressor:
    """Sign compression with one `mean |x|` scale per chunk of `chunk_numel` elements.

    `||x - decompress(compress(x))||₂ <= sqrt(1 - 1/chunk_numel) · ||x||₂` (module docstring).
    """

    chunk_numel: int | None = None
    """Elements sharing one scale; `None`: one scale for the whole tensor."""

    def __post_init__(self) -> None:
        c = self.chunk_numel
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(
                f"chunk_numel must be a positive int or None (one scale per tensor), got {c!r}"
            )

    def chunk_for(self, numel: int) -> int:
        """The chunk length used for a vector of `numel` elements."""
        return self.chunk_numel if self.chunk_numel is not None else max(numel, 1)

    def compress(self, x: torch.Tensor) -> SignPacked:
        """Sign bits and chunk scales of `x` (flattened, as fp32)."""
        chunk = self.chunk_for(x.numel())
        bits, scales = ops.sign_pack(x, chunk)
        return SignPacked(scales, bits, x.numel(), chunk)

    def decompress(self, packed: SignPacked) -> torch.Tensor:
        """fp32 `[numel]`: `±scale` per element."""
        return ops.sign_unpack(packed.bits, packed.scales, packed.chunk_numel, packed.numel)

    def packed_nbytes(self, numel: int) -> int:
        """`ceil(numel / 8) + 4 ceil(numel / chunk)`."""
        return -(-numel // 8) + 4 * -(-numel // self.chunk_for(numel))
