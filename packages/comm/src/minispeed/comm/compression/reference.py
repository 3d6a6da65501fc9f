"""Pure-PyTorch reference of the compression kernels: the specification, the tests' oracle, the fallback.

Each function has the signature of its compiled twin in `ops` and gives the same bytes
(the sign scales may differ in the last bit: both sum in float64, in different orders). The
wire formats are defined here, in code (`csrc/compression/compression.h` repeats them in prose):

* **sign bits** — element `i` goes to byte `i // 8`, bit `i % 8` (least significant first);
  the bit is 1 iff `x[i] < 0` (`-0.0` and NaN count as positive); unused bits of the last byte
  are 0. One fp32 scale per chunk of `chunk_numel` elements: the mean of `|x|` over the chunk.
* **int8 / int4 blocks** — symmetric absmax quantization per block of `block_numel` elements:
  `s = max|x| / qmax` (qmax 127 or 7), `q = clamp(round_half_even(x / s), -qmax, qmax)`; an
  all-zero block has `s = 0` and `q = 0`. Non-finite blocks: a block holding a NaN has
  `s = NaN` (the canonical quiet NaN), one holding ±inf and no NaN `s = +inf`; `q = 0`
  wherever `x / s` is NaN, so every code of such a block is 0 and it dequantizes to NaN
  throughout. int8 is stored as two's-complement bytes; int4 puts
  element `2j` in the low nibble of byte `j` and `2j + 1` in the high nibble.
* **top-k** — the `k` largest `|x|` (ties: lower index first), indices ascending, int32.

Inputs are 1-D contiguous fp32 tensors (the wrappers in `ops` flatten and cast). Slow on
purpose where clarity costs memory: e.g. `sign_pack` makes a float64 copy (8 B/element).
"""

from __future__ import annotations

import torch

__all__ = [
    "dequantize_blocks",
    "qmax_for_bits",
    "quantize_blocks",
    "sign_pack",
    "sign_unpack",
    "sparse_accumulate_",
    "topk_select",
]

# Bit weights of one byte, least significant first: bit j of a byte holds element 8 * byte + j.
_BIT_WEIGHTS = [1 << j for j in range(8)]


def qmax_for_bits(bits: int) -> int:
    """Largest quantized magnitude: 127 for int8, 7 for int4 (symmetric: -qmax..qmax)."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    return 127 if bits == 8 else 7


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _padded(x: torch.Tensor, numel: int) -> torch.Tensor:
    """`x` followed by zeros up to `numel` elements (a new tensor)."""
    out = x.new_zeros(numel)
    out[: x.numel()] = x
    return out


# -- 1-bit sign compression ------------------------------------------------------------------
def sign_pack(x: torch.Tensor, chunk_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Signs of `x` as bits and the mean `|x|` of every chunk.

    Returns `(bits, scales)`: uint8 `[ceil(n / 8)]` and fp32 `[ceil(n / chunk_numel)]`.
    """
    n = x.numel()
    n_bytes, n_chunks = _ceil_div(n, 8), _ceil_div(n, chunk_numel)
    negative = _padded((x < 0).to(torch.uint8), n_bytes * 8).view(n_bytes, 8)  # (bytes, 8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32, device=x.device)
    # Distinct powers of two: the sum is the OR, at most 255.
    bits = (negative.to(torch.int32) * weights).sum(dim=1).to(torch.uint8)
    # Zeros padding the last chunk add nothing to its sum; divide by its true length.
    sums = _padded(x.abs().double(), n_chunks * chunk_numel).view(n_chunks, chunk_numel).sum(1)
    counts = torch.full((n_chunks,), float(chunk_numel), dtype=torch.float64, device=x.device)
    if n_chunks:
        counts[-1] = n - (n_chunks - 1) * chunk_numel
    return bits, (sums / counts).float()


def sign_unpack(
    bits: torch.Tensor, scales: torch.Tensor, chunk_numel: int, numel: int
) -> torch.Tensor:
    """`-scale` where the bit is set, `+scale` where not, for `numel` elements (fp32)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    negative = ((bits[:, None] >> shifts) & 1).view(-1)[:numel].bool()  # (numel,)
    chunk_of = torch.arange(numel, device=bits.device) // chunk_numel
    s = scales[chunk_of]
    return torch.where(negative, -s, s)


# -- block quantization ---------------------------------------------------------------------
def quantize_blocks(
    x: torch.Tensor, block_numel: int, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantization per block. Returns `(q, scales)`.

    `q` is uint8 `[n]` (int8 bytes) or `[ceil(n / 2)]` (int4 nibble pairs); `scales` fp32
    `[ceil(n / block_numel)]`. Per-element error: `|x - s * q| <= s / 2 = absmax / (2 qmax)`.
    """
    qmax = qmax_for_bits(bits)
    n = x.numel()
    n_blocks = _ceil_div(n, block_numel)
    blocks = _padded(x, n_blocks * block_numel).view(n_blocks, block_numel)  # (blocks, block)
    scales = blocks.abs().amax(dim=1) / qmax if n else x.new_zeros(0)
    # A block holding a NaN has a NaN scale: the canonical quiet NaN, whatever NaN the input held.
    scales = torch.where(torch.isnan(scales), torch.nan, scales)
    # A zero scale means an all-zero block (or one so small that absmax / qmax underflows): its
    # elements divided by 1 round to 0, as the C++ op's explicit "s == 0 -> q = 0" gives.
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    r = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax)
    # x / s is NaN for a NaN element, every element of a NaN block and +-inf / inf: code 0, so a
    # non-finite block dequantizes to NaN throughout (0 * NaN, 0 * inf).
    q = torch.where(torch.isnan(r), 0.0, r).to(torch.int16).view(-1)[:n]
    if bits == 8:
        return q.to(torch.int8).view(torch.uint8), scales
    nibbles = _padded(q & 0xF, _ceil_div(n, 2) * 2).view(-1, 2)  # (bytes, 2): low, high
    return (nibbles[:, 0] | (nibbles[:, 1] << 4)).to(torch.uint8), scales


def dequantize_blocks(
    q: torch.Tensor, scales: torch.Tensor, block_numel: int, bits: int, numel: int
) -> torch.Tensor:
    """Inverse of `quantize_blocks`: `q * s` per block, fp32 `[numel]`."""
    qmax_for_bits(bits)
    if bits == 8:
        values = q.view(torch.int8).to(torch.float32)
    else:
        pairs = torch.stack([q & 0xF, q >> 4], dim=1).view(-1)[:numel].to(torch.int16)
        values = ((pairs ^ 8) - 8).to(torch.float32)  # sign-extend the two's-complement nibbles
    block_of = torch.arange(numel, device=q.device) // block_numel
    return values * scales[block_of]


# -- top-k sparsification ----------------------------------------------------------------------
def topk_select(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest-magnitude elements: `(values fp32 [k], indices int32 [k] ascending)`.

    Ties in magnitude go to the lower index, so the selection is unique. Raises `ValueError` for
    NaN input (no order exists).
    """
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, numel={n}], got {k}")
    if k == 0:
        return x.new_empty(0), torch.empty(0, dtype=torch.int32, device=x.device)
    magnitude = x.abs()
    if torch.isnan(magnitude).any():
        raise ValueError(
            "top-k input holds NaN, so no order exists; find where the gradient overflows "
            "(e.g. enable loss scaling) before compressing"
        )
    threshold = torch.topk(magnitude, k, sorted=True).values[-1]  # k-th largest: unique value
    above = magnitude > threshold
    ties = magnitude == threshold
    ties_wanted = k - int(above.sum())
    # Keep the first `ties_wanted` ties in index order.
    keep = above | (ties & (torch.cumsum(ties.to(torch.int64), 0) <= ties_wanted))
    indices = torch.nonzero(keep).view(-1)
    return x[indices], indices.to(torch.int32)


def sparse_accumulate_(
    out: torch.Tensor, values: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """`out[indices[j]] += values[j]` in place (indices unique within one call). Returns `out`."""
    if values.numel() != indices.numel():
        raise ValueError(
            f"values ({values.numel()}) and indices ({indices.numel()}) must have the same length"
        )
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= out.numel()):
        raise ValueError(
            f"indices fall outside [0, {out.numel()}): they do not belong to this tensor"
        )
    return out.index_add_(0, indices.to(torch.int64), values)
