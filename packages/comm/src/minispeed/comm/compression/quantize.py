"""int8 / int4 block quantization for communication (ZeRO++'s qwZ weights and qgZ gradients).

A block `v` of `B` elements is sent as `s = max |v| / qmax` (fp32) and the codes
`q_i = clamp(round(v_i / s), -qmax, qmax)` with `qmax = 127` (int8) or `7` (int4), and is
rebuilt as `s q_i`. Symmetric (no zero point): gradients and weights are centred near zero.

Error bound (derivation). Rounding moves `v_i / s` by at most 1/2, so `|v_i - s q_i| <= s/2
= max|v| / (2 qmax)`; an element with `|v_i| < s/2` becomes 0, so also `|v_i - s q_i| <=
|v_i|`. Hence elementwise:

```text
|v_i - v̂_i|  <=  min(|v_i|, max|v| / (2 qmax))
```

and per block `||v - v̂||² <= ||v||² - max|v|² <= (1 - 1/B) ||v||²` (the largest element is
rebuilt exactly, up to one rounding of `s`): a contraction, so error feedback applies. Relative
to the block's largest element the error is at most 0.39 % for int8 and 7.1 % for int4.

Bytes: `ceil(n bits / 8)` of codes plus `4 ceil(n / B)` of scales; against fp32 that is
`32 / (bits + 32/B)`-fold fewer: 3.9x (int8) and 7.8x (int4) at `B = 256`.
"""

from __future__ import annotations

import dataclasses

import torch

from minispeed.comm.compression import ops
from minispeed.comm.compression.compressor import ScaledCodes

__all__ = ["BlockQuantizer"]


@dataclasses.dataclass(frozen=True)
class BlockQuantizer:
    """Symmetric absmax quantization to `bits` (8 or 4) per block of `block_numel` elements.

    Elementwise `|x_i - x̂_i| <= min(|x_i|, max|block| / (2 qmax))` (module docstring).
    """

    bits: int = 8
    """8 (int8 codes) or 4 (two int4 codes per byte)."""
    block_numel: int = 256
    """Elements sharing one fp32 scale; even for int4."""

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {self.bits!r}")
        b = self.block_numel
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"block_numel must be a positive int, got {b!r}")
        if self.bits == 4 and b % 2:
            raise ValueError(
                f"int4 stores two codes per byte, so block_numel must be even; got {b} "
                f"(use {b + 1})"
            )

    @property
    def qmax(self) -> int:
        """127 for int8, 7 for int4."""
        return 127 if self.bits == 8 else 7

    def padded_numel(self, numel: int) -> int:
        """`numel` rounded up to whole blocks (how collectives pad each rank's part)."""
        return -(-numel // self.block_numel) * self.block_numel

    def compress(self, x: torch.Tensor) -> ScaledCodes:
        """Codes (int8: one byte each; int4: two per byte) and block scales of `x` (flattened,
        as fp32)."""
        q, scales = ops.quantize_blocks(x, self.block_numel, self.bits)
        return ScaledCodes(scales, q, x.numel(), self.bits, self.block_numel)

    def decompress(self, packed: ScaledCodes) -> torch.Tensor:
        """fp32 `[numel]`: code times its block's scale."""
        return ops.dequantize_blocks(
            packed.codes, packed.scales, packed.group_numel, packed.code_bits, packed.numel
        )

    def packed_nbytes(self, numel: int) -> int:
        """`ceil(numel bits / 8) + 4 ceil(numel / block_numel)`."""
        return ScaledCodes.nbytes_for(numel, self.bits, self.block_numel)
