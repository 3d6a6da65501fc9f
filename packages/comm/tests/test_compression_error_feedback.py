"""Each compressor meets the error bound its docstring derives; error feedback keeps the
accumulated error bounded over many steps, and without it the error grows.
"""

from __future__ import annotations

import math

import pytest
import torch

from minispeed.comm.compression import (
    BlockQuantizer,
    ErrorFeedback,
    OnebitCompressor,
    ScaledCodes,
    TopkCompressor,
    TopkPacked,
    wire,
)

COMPRESSORS = {
    "onebit": OnebitCompressor(chunk_numel=64),
    "topk": TopkCompressor(ratio=0.05),
    "int8": BlockQuantizer(bits=8, block_numel=32),
    "int4": BlockQuantizer(bits=4, block_numel=32),
}


def _gradient_like(n: int, seed: int) -> torch.Tensor:
    """Heavy-tailed, uneven magnitudes: a harder case than a plain Gaussian."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3) * 10


@pytest.mark.parametrize("seed", range(5))
def test_onebit_error_is_within_sqrt_one_minus_one_over_chunk(seed):
    x = _gradient_like(1000, seed)
    c = OnebitCompressor(chunk_numel=64)
    err = x - c.decompress(c.compress(x))
    assert err.norm() <= math.sqrt(1 - 1 / 64) * x.norm()
    # The scale is the error-minimizing one: no other single scale per chunk does better.
    for factor in (0.9, 1.1):
        other = c.decompress(c.compress(x)) * factor
        assert (x - other).norm() > err.norm()


@pytest.mark.parametrize("seed", range(5))
def test_topk_error_is_within_sqrt_one_minus_k_over_n(seed):
    x = _gradient_like(1000, seed)
    c = TopkCompressor(ratio=0.05)
    k = c.k_for(1000)
    assert k == 50
    err = x - c.decompress(c.compress(x))
    assert err.norm() <= math.sqrt(1 - k / 1000) * x.norm()
    assert (err != 0).sum() == 1000 - k  # exactly the k largest were kept


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("seed", range(3))
def test_quantization_error_is_within_half_a_step_of_each_block(bits, seed):
    q = BlockQuantizer(bits=bits, block_numel=32)
    x = _gradient_like(1000, seed)
    err = (x - q.decompress(q.compress(x))).abs()
    blocks = torch.nn.functional.pad(x, (0, 1024 - 1000)).view(-1, 32)
    step = blocks.abs().amax(dim=1) / q.qmax  # the scale of each block
    bound = torch.minimum(x.abs(), (step / 2).repeat_interleave(32)[:1000] * (1 + 1e-6))
    assert torch.all(err <= bound)


@pytest.mark.parametrize("name", COMPRESSORS)
def test_packed_bytes_match_the_formula_and_round_trip(name):
    compressor = COMPRESSORS[name]
    x = _gradient_like(640, 0)
    packed = compressor.compress(x)
    assert packed.to_bytes().numel() == packed.nbytes == compressor.packed_nbytes(640)
    buf = packed.to_bytes()
    if isinstance(packed, TopkPacked):
        again = TopkPacked.from_bytes(buf, 640)
    else:
        again = ScaledCodes.from_rows(buf[None], 640, packed.code_bits, packed.group_numel)
    assert torch.equal(compressor.decompress(again), compressor.decompress(packed))


def test_onebit_is_about_32x_smaller_than_fp32():
    compressor = OnebitCompressor(chunk_numel=2048)
    ratio = 4 * 2048 * 64 / compressor.packed_nbytes(2048 * 64)
    assert ratio == pytest.approx(32 / (1 + 32 / 2048))
    assert wire.onebit_chunk_numel(1000, 4) == 256


def _accumulated_errors(compressor, xs, feedback: bool) -> list[float]:
    """||Σ_{s<=t} (decompress(compress(...)) - x_s)|| after each step t."""
    ef = ErrorFeedback(compressor)
    total = torch.zeros_like(xs[0])
    norms = []
    for x in xs:
        sent = compressor.decompress(ef.compress(x) if feedback else compressor.compress(x))
        total += sent - x
        norms.append(float(total.norm()))
    return norms


# δ of each compressor: ||x - x̂||² <= (1 - δ) ||x||² (the contraction its docstring derives).
DELTA = {"onebit": 1 / 64, "topk": 0.05, "int8": 1 / 32, "int4": 1 / 32}


@pytest.mark.parametrize("name", COMPRESSORS)
def test_error_feedback_keeps_the_accumulated_error_bounded_and_without_it_it_grows(name):
    compressor = COMPRESSORS[name]
    base = torch.randn(512, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    # A persistent component (the same distortion every step) plus fresh noise.
    xs = [base + 0.1 * torch.randn(512, generator=g) for _ in range(200)]
    grad_bound = max(float(x.norm()) for x in xs)

    with_ef = _accumulated_errors(compressor, xs, feedback=True)
    without = _accumulated_errors(compressor, xs, feedback=False)

    # With feedback Σ sent - Σ x = -e_T, and ||e_T|| <= q G / (1 - q), q = sqrt(1 - δ).
    q = math.sqrt(1 - DELTA[name])
    assert max(with_ef) <= q / (1 - q) * grad_bound
    assert with_ef[199] <= 1.3 * with_ef[99]  # it levels off ...
    assert without[199] >= 1.3 * without[99]  # ... where the error without feedback keeps growing
    assert without[199] >= 5 * with_ef[199]


def test_error_feedback_identity_sent_sum_equals_true_sum_minus_residual():
    compressor = OnebitCompressor(chunk_numel=32)
    ef = ErrorFeedback(compressor)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(100, generator=g) for _ in range(50)]
    sent = sum(compressor.decompress(ef.compress(x)) for x in xs)
    torch.testing.assert_close(sent, sum(xs) - ef.residual, rtol=1e-5, atol=1e-4)


def test_error_feedback_refuses_a_tensor_of_another_size():
    ef = ErrorFeedback(OnebitCompressor())
    ef.compress(torch.ones(10))
    with pytest.raises(ValueError, match="one ErrorFeedback per tensor"):
        ef.compress(torch.ones(11))
    ef.reset()
    ef.compress(torch.ones(11))
    with pytest.raises(TypeError, match="not a compressor"):
        ErrorFeedback(object())


def test_compressor_configs_reject_bad_values_with_the_fix():
    with pytest.raises(ValueError, match="chunk_numel"):
        OnebitCompressor(chunk_numel=0)
    with pytest.raises(ValueError, match="ratio"):
        TopkCompressor(ratio=1.5)
    with pytest.raises(ValueError, match="use 34"):
        BlockQuantizer(bits=4, block_numel=32 + 1)


def test_a_nan_residual_poisons_its_block_until_reset():
    # Documented in error_feedback.py: after a non-finite step, call reset() before the next.
    ef = ErrorFeedback(BlockQuantizer(8, 16))
    x = torch.ones(64)
    bad = x.clone()
    bad[20] = float("nan")
    ef.compress(bad)
    assert ef.residual[16:32].isnan().all() and ef.residual[32:].isfinite().all()
    again = ef.compressor.decompress(ef.compress(x))  # a finite input, but the residual is NaN
    assert again[16:32].isnan().all() and again[:16].isfinite().all()
    ef.reset()
    assert ef.compressor.decompress(ef.compress(x)).isfinite().all()
