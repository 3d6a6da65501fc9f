"""The compression kernels (C++ op, every compiled SIMD path) give the reference's bytes.

Sizes cover 0, 1, below/at/above one byte of bits (8), one AVX2 vector (8 floats), one AVX-512
vector (16 floats), and odd sizes between; chunks and blocks that do and do not divide them.
The op is built (or loaded from the cache) once for the module; if it cannot be built here, the
comparisons skip and the fallback test still runs.
"""

from __future__ import annotations

import pytest
import torch

from minispeed.comm.compression import ops
from minispeed.comm.compression import reference as ref
from minispeed.core.op_builder import DISABLE_ENV

SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1000, 4099]
LEVEL_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}


@pytest.fixture(scope="module")
def op():
    module = ops.load_op("cpu")
    if module is None:
        pytest.skip("the compression C++ op cannot be built here (see the fallback warning)")
    return module


def _data(n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if n > 4:  # signed zeros must count as positive in every path
        x[1], x[2] = -0.0, 0.0
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_every_simd_level_this_cpu_has_is_compiled(op):
    from minispeed.core.op_builder import requested_simd_level

    assert op.simd_levels() == list(range(int(requested_simd_level()) + 1))


@pytest.mark.parametrize("n", SIZES)
def test_sign_pack_unpack_match_reference_bit_for_bit(op, n):
    x = _data(n)
    for chunk in (1, 3, 8, 16, 37, 1000):
        ref_bits, ref_scales = ref.sign_pack(x, chunk)
        for level in op.simd_levels():
            bits, scales = op.sign_pack(x, chunk, level)
            assert _same_bits(bits, ref_bits), (LEVEL_NAMES[level], chunk)
            # Both sum |x| in float64; only the summation order differs.
            torch.testing.assert_close(scales, ref_scales, rtol=1e-6, atol=0)
            out = op.sign_unpack(bits, ref_scales, chunk, n, level)
            assert _same_bits(out, ref.sign_unpack(bits, ref_scales, chunk, n))


def test_sign_bits_layout_is_lsb_first_and_negative_is_one():
    x = torch.tensor([-1.0, 2.0, -0.0, -3.0, 0.5, 0.5, 0.5, -0.5, -9.0])
    bits, scales = ops.sign_pack(x, chunk_numel=8)
    # byte 0: elements 0..7, negative at 0, 3, 7 -> 0b1000_1001; byte 1: element 8 -> 0b1
    assert bits.tolist() == [0b10001001, 0b1]
    assert scales.tolist() == [1.0, 9.0]  # mean |x| of each chunk: 8 / 8, then 9 / 1
    assert ops.sign_unpack(bits, scales, 8, 9).tolist() == [-1, 1, 1, -1, 1, 1, 1, -1, -9]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", SIZES)
def test_block_quantization_matches_reference_bit_for_bit(op, n, bits):
    x = _data(n)
    if n > 40:
        x[20:40] = 0.0  # an all-zero block (scale 0) for the smaller block sizes
    for block in (2, 4, 16, 18, 64, 1000):
        ref_q, ref_scales = ref.quantize_blocks(x, block, bits)
        for level in op.simd_levels():
            q, scales = op.quantize_blocks(x, block, bits, level)
            assert _same_bits(scales, ref_scales), (LEVEL_NAMES[level], block)
            assert _same_bits(q, ref_q), (LEVEL_NAMES[level], block)
            out = op.dequantize_blocks(q, scales, block, bits, n, level)
            assert _same_bits(out, ref.dequantize_blocks(q, scales, block, bits, n))


def _non_finite_cases() -> dict[str, torch.Tensor]:
    """Inputs whose blocks hold NaN, +inf, -inf, mixes of them, in vector bodies and tails."""
    nan, inf = float("nan"), float("inf")
    cases = {}
    for n in (5, 16, 37, 100):
        for name, values in {
            "nan": [nan],
            "pos_inf": [inf],
            "neg_inf": [-inf],
            "nan_and_inf": [nan, inf, -inf],
            "negative_nan": [-nan],  # sign bit set: the scale is still the canonical NaN
        }.items():
            for where in {0, n // 2, n - 1}:  # first lane, a middle lane, the last (tail) lane
                x = _data(n, seed=n + where)
                for j, v in enumerate(values):
                    x[(where + 3 * j) % n] = v
                cases[f"{name}-n{n}-at{where}"] = x
    return cases


_NON_FINITE = _non_finite_cases()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", sorted(_NON_FINITE))
def test_block_quantization_of_nan_and_inf_matches_reference_bit_for_bit(op, case, bits):
    x = _NON_FINITE[case]
    for block in (4, 16, 18, 1000):
        ref_q, ref_scales = ref.quantize_blocks(x, block, bits)
        values = ref.dequantize_blocks(ref_q, ref_scales, block, bits, x.numel())
        for part, out in zip(x.split(block), values.split(block)):
            # a block holding a NaN or +-inf dequantizes to NaN throughout; others stay finite
            assert bool(out.isnan().all() if not part.isfinite().all() else out.isfinite().all())
        for level in op.simd_levels():
            q, scales = op.quantize_blocks(x, block, bits, level)
            assert _same_bits(scales, ref_scales), (LEVEL_NAMES[level], block)
            assert _same_bits(q, ref_q), (LEVEL_NAMES[level], block)
            out = op.dequantize_blocks(q, scales, block, bits, x.numel(), level)
            assert _same_bits(out, values), (LEVEL_NAMES[level], block)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantization_rounds_half_to_even_and_packs_nibbles_low_first(bits):
    qmax = 127 if bits == 8 else 7
    # absmax = qmax makes the scale exactly 1, so x / s is x: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2.
    x = torch.tensor([float(qmax), 2.5, 3.5, -2.5, -1.0, 0.0])
    q, scales = ops.quantize_blocks(x, block_numel=6, bits=bits)
    assert scales.tolist() == [1.0]
    codes = [qmax, 2, 4, -2, -1, 0]
    if bits == 8:
        assert q.view(torch.int8).tolist() == codes
    else:
        assert q.tolist() == [
            (c0 & 0xF) | ((c1 & 0xF) << 4) for c0, c1 in zip(codes[::2], codes[1::2])
        ]
    assert ops.dequantize_blocks(q, scales, 6, bits, 6).tolist() == [float(c) for c in codes]


@pytest.mark.parametrize("n", [n for n in SIZES if n])
def test_topk_select_matches_reference_including_ties(op, n):
    x = _data(n)
    ties = torch.round(x * 2) / 2  # many equal magnitudes: the lower index must win
    for k in sorted({1, n // 3, n // 2, n}):
        for data in (x, ties):
            ref_values, ref_indices = ref.topk_select(data, k)
            assert torch.all(ref_indices[1:] > ref_indices[:-1])
            for level in op.simd_levels():
                values, indices = op.topk_select(data, k, level)
                assert torch.equal(indices, ref_indices), (LEVEL_NAMES[level], k)
                assert _same_bits(values, ref_values)


def test_topk_keeps_the_largest_magnitudes_and_lower_index_on_ties():
    x = torch.tensor([1.0, -5.0, 2.0, 5.0, -2.0, 0.5])
    values, indices = ops.topk_select(x, 3)
    assert indices.tolist() == [1, 2, 3]  # |-5|, |5|, then the first |2| (index 2, not 4)
    assert values.tolist() == [-5.0, 2.0, 5.0]


def test_sparse_accumulate_matches_index_add(op):
    out = torch.randn(50)
    values, indices = torch.randn(10), torch.randperm(50)[:10].to(torch.int32)
    expected = out.clone().index_add_(0, indices.long(), values)
    op.sparse_accumulate_(out, values, indices)
    assert _same_bits(out, expected)


def test_bad_input_raises_clear_errors_and_leaves_output_untouched():
    out = torch.zeros(4)
    with pytest.raises(ValueError, match="outside"):
        ops.sparse_accumulate_(out, torch.ones(2), torch.tensor([1, 7], dtype=torch.int32))
    assert out.abs().sum() == 0
    with pytest.raises(ValueError, match="NaN"):
        ops.topk_select(torch.tensor([1.0, float("nan")]), 1)
    with pytest.raises(ValueError, match="even"):
        ops.quantize_blocks(torch.ones(8), block_numel=3, bits=4)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        ops.quantize_blocks(torch.ones(8), block_numel=4, bits=2)
    with pytest.raises(ValueError, match="bytes"):
        ops.sign_unpack(torch.zeros(1, dtype=torch.uint8), torch.ones(1), 8, 9)
    with pytest.raises(TypeError, match="floating-point"):
        ops.sign_pack(torch.ones(8, dtype=torch.int64), 8)


def test_disabled_op_falls_back_to_reference(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "comm_compression")
    assert ops.load_op("cpu") is None
    x = _data(100)
    bits, scales = ops.sign_pack(x, 16)
    ref_bits, ref_scales = ref.sign_pack(x, 16)
    assert torch.equal(bits, ref_bits) and torch.equal(scales, ref_scales)


def test_compressors_send_the_same_bytes_through_the_fallback(monkeypatch):
    from minispeed.comm.compression import BlockQuantizer, OnebitCompressor, TopkCompressor

    x = _data(1000, seed=3)
    compressors = [OnebitCompressor(64), TopkCompressor(ratio=0.1), BlockQuantizer(4, 32)]
    compiled = [c.compress(x).to_bytes() for c in compressors]
    monkeypatch.setenv(DISABLE_ENV, "comm_compression")
    for c, want in zip(compressors, compiled):
        got = c.compress(x).to_bytes()
        if isinstance(c, OnebitCompressor):  # scales may differ in the last bit; bits may not
            assert torch.equal(got[4 * 16 :], want[4 * 16 :])
            torch.testing.assert_close(
                got[: 4 * 16].view(torch.float32), want[: 4 * 16].view(torch.float32)
            )
        else:
            assert torch.equal(got, want)
