"""MINISPEED_SIMD=scalar builds a separate, plain-C++ variant of the cast op with the same bits."""

from __future__ import annotations

import pytest
import torch

from minispeed.core.op_builder import SIMD_ENV, SimdLevel, cpu_simd_level
from minispeed.core.ops import cast
from minispeed.core.ops.cast import CastBuilder

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def scalar_cache_dir():
    """Build (or load) the scalar variant once; return its cache directory."""
    builder = CastBuilder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SIMD_ENV, "scalar")
        ok, why = builder.is_compatible()
        if not ok:
            pytest.skip(f"cast op cannot be built here: {why}")
        builder.load()
        return builder.cache_dir()


@pytest.fixture
def scalar(monkeypatch, scalar_cache_dir):
    monkeypatch.setenv(SIMD_ENV, "scalar")
    return scalar_cache_dir


def test_scalar_variant_has_its_own_cache_entry(scalar, monkeypatch):
    builder = CastBuilder()
    assert builder.cache_dir() == scalar
    assert builder.load().simd_level() == "scalar"
    if cpu_simd_level() != SimdLevel.SCALAR:
        monkeypatch.delenv(SIMD_ENV)
        assert builder.cache_dir() != scalar


@pytest.mark.parametrize("n", [0, 7, 16, 33, 32768 + 9])
def test_scalar_cast_matches_reference(scalar, n):
    g = torch.Generator().manual_seed(n)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    got = cast.float_to_bf16(x)  # the public wrapper follows MINISPEED_SIMD
    assert torch.equal(got.view(torch.int16), cast.reference.float_to_bf16(x).view(torch.int16))
    assert torch.equal(
        cast.bf16_to_float(got).view(torch.int32),
        cast.reference.bf16_to_float(got).view(torch.int32),
    )


def test_scalar_flatten_matches_reference(scalar):
    params = [torch.randn(5, 3), torch.randn(0), torch.randn(100)]
    got = cast.flatten(params, dtype=torch.bfloat16)
    want = cast.reference.flatten(params, dtype=torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
