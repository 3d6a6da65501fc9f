"""The compiled fp32 <-> bf16 cast and flatten/unflatten give the reference's bits (and torch's).

Uses the op at this CPU's SIMD level, from the shared op cache (built once per machine).
"""

from __future__ import annotations

import pytest
import torch

from minispeed.core.op_builder import OpBuildError, requested_simd_level
from minispeed.core.ops import cast
from minispeed.core.ops.cast import CastBuilder

pytestmark = pytest.mark.timeout(300)

# (fp32 bits, expected bf16 bits): Note [bf16 round-to-nearest-even] in csrc/include/minispeed/simd.h.
SPECIAL_CASES = [
    (0x00000000, 0x0000),  # +0
    (0x80000000, 0x8000),  # -0
    (0x7F800000, 0x7F80),  # +inf
    (0xFF800000, 0xFF80),  # -inf
    (0x7FC00000, 0x7FC0),  # quiet NaN
    (0x7F800001, 0x7FC0),  # signalling NaN: quieted, never rounded to inf
    (0xFFC00001, 0x7FC0),  # negative NaN with payload
    (0x7FFFFFFF, 0x7FC0),  # NaN whose rounding would carry
    (0x3F808000, 0x3F80),  # tie, kept lsb even: round down
    (0x3F818000, 0x3F82),  # tie, kept lsb odd: round up to even
    (0x3F808001, 0x3F81),  # just above the tie
    (0x3F807FFF, 0x3F80),  # just below the tie
    (0xBF818000, 0xBF82),  # negative tie rounds to even magnitude
    (0x7F7FFFFF, 0x7F80),  # largest finite fp32 rounds to +inf
    (0xFF7FFFFF, 0xFF80),  # ... and to -inf
    (0x7F7F7FFF, 0x7F7F),  # stays finite below the half
    (0x00000001, 0x0000),  # smallest denormal rounds to 0
    (0x00008000, 0x0000),  # denormal tie, even: down
    (0x00018000, 0x0002),  # denormal tie, odd: up
    (0x007FFFFF, 0x0080),  # largest denormal rounds up to the smallest normal
    (0x80008001, 0x8001),  # negative denormal above the tie
]


def _bits32(values: list[int]) -> torch.Tensor:
    """fp32 tensor with the given raw bit patterns."""
    signed = [v - (1 << 32) if v >= 1 << 31 else v for v in values]
    return torch.tensor(signed, dtype=torch.int32).view(torch.float32)


def _u16(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFF for v in t.view(torch.int16).tolist()]


def _random_fp32_bits(n: int, seed: int) -> torch.Tensor:
    """Every kind of fp32: normals, denormals, infs and NaNs of both signs."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64)
        .to(torch.int32)
        .view(torch.float32)
    )


def _assert_same_as_torch(x: torch.Tensor, got: torch.Tensor) -> None:
    """Equal to torch's .to(bfloat16) bit for bit, except NaN payloads (torch's vector path differs)."""
    ours, theirs = got.view(torch.int16), x.to(torch.bfloat16).view(torch.int16)
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(ours[~nan], theirs[~nan])


@pytest.fixture(scope="module")
def op():
    builder = CastBuilder()
    ok, why = builder.is_compatible()
    if not ok:
        pytest.skip(f"cast op cannot be built here: {why}")
    try:
        return builder.load()
    except OpBuildError as err:
        pytest.fail(f"the cast op must build where it is compatible: {err}")


def test_built_for_the_requested_simd_level(op):
    assert op.simd_level() == requested_simd_level().label


def test_special_values_match_hand_computed_bits(op):
    x = _bits32([bits for bits, _ in SPECIAL_CASES])
    expected = [bf16 for _, bf16 in SPECIAL_CASES]
    assert _u16(cast.float_to_bf16(x)) == expected
    assert _u16(cast.reference.float_to_bf16(x)) == expected
    _assert_same_as_torch(x, cast.float_to_bf16(x))


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 33, 1000, 2 * 32768 + 3])
def test_random_bit_patterns_match_reference_and_torch(op, n):
    x = _random_fp32_bits(n, seed=n)
    got = cast.float_to_bf16(x)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), cast.reference.float_to_bf16(x).view(torch.int16))
    _assert_same_as_torch(x, got)


def test_bf16_to_float_is_exact_for_all_65536_patterns(op):
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    got = cast.bf16_to_float(h)
    assert torch.equal(got.view(torch.int32), cast.reference.bf16_to_float(h).view(torch.int32))
    nan = torch.isnan(got)
    assert torch.equal(got[~nan], h.float()[~nan])
    assert torch.equal(cast.float_to_bf16(got).view(torch.int16)[~nan], h.view(torch.int16)[~nan])


def test_out_variants_fill_and_return_out(op):
    x = torch.randn(4, 37)
    out = torch.empty(4, 37, dtype=torch.bfloat16)
    assert cast.float_to_bf16(x, out=out) is out
    assert torch.equal(out.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))

    back = torch.empty(37, 4).t()  # non-contiguous out
    assert cast.bf16_to_float(out, out=back) is back
    assert torch.equal(back, out.float())

    y = torch.randn(37, 4).t()  # non-contiguous src
    assert torch.equal(
        cast.float_to_bf16(y).view(torch.int16), y.to(torch.bfloat16).view(torch.int16)
    )


def test_out_aliasing_src_gives_the_same_bits(op):
    """Halving a buffer in place (out is a bf16 view of the fp32 src's memory) must still be exact."""
    buf = _random_fp32_bits(2 * 32768 + 5, seed=7)
    expected = cast.reference.float_to_bf16(buf.clone())
    out = buf.view(torch.bfloat16)[: buf.numel()]
    cast.float_to_bf16(buf, out=out)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_bad_arguments_name_the_fix(op):
    with pytest.raises(TypeError, match=r"float32.*\.float\(\)"):
        cast.float_to_bf16(torch.ones(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="bfloat16"):
        cast.float_to_bf16(torch.ones(3), out=torch.empty(3))
    with pytest.raises(ValueError, match="shape"):
        cast.float_to_bf16(torch.ones(3), out=torch.empty(4, dtype=torch.bfloat16))


def test_thread_count_does_not_change_bits(op):
    x = _random_fp32_bits(8 * 32768 + 11, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert op.max_threads() == 1, "the op must follow torch.set_num_threads"
        one = cast.float_to_bf16(x)
        torch.set_num_threads(2)
        two = cast.float_to_bf16(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.view(torch.int16), two.view(torch.int16))


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (0,), (32768 + 7,), (1,), (17, 2, 3), (0, 4)]
    return [torch.randn(s, generator=g) for s in shapes]


def test_flatten_casts_into_slots_and_leaves_gaps(op):
    params = _params()
    offsets, o = [], 0
    for p in params:
        offsets.append(o)
        o += p.numel() + 3  # 3-element gaps
    flat = torch.full((o,), 9.0, dtype=torch.bfloat16)
    expected = cast.reference.flatten(params, flat.clone(), offsets)
    assert cast.flatten(params, flat, offsets) is flat
    assert torch.equal(flat.view(torch.int16), expected.view(torch.int16))
    for p, off in zip(params, offsets):
        assert torch.equal(
            flat[off + p.numel() : off + p.numel() + 3], torch.full((3,), 9.0, dtype=torch.bfloat16)
        )


@pytest.mark.parametrize("flat_dtype", [torch.bfloat16, torch.float32])
def test_unflatten_inverts_flatten(op, flat_dtype):
    params = _params()
    flat = cast.flatten(params, dtype=flat_dtype)
    assert flat.numel() == sum(p.numel() for p in params)
    restored = [torch.empty_like(p) for p in params]
    restored[4] = torch.empty(3, 2, 17).permute(2, 1, 0)  # non-contiguous target
    assert cast.unflatten(flat, restored) == restored
    for p, r in zip(params, restored):
        want = p.bfloat16().float() if flat_dtype == torch.bfloat16 else p
        assert torch.equal(r, want)


def test_flatten_layout_errors_name_the_fix(op):
    a, b = torch.ones(4), torch.ones(4)
    flat = torch.empty(8)
    with pytest.raises(ValueError, match="overlap"):
        cast.flatten([a, b], flat, offsets=[0, 2])
    with pytest.raises(ValueError, match="enlarge flat"):
        cast.flatten([a, b], flat, offsets=[0, 5])
    with pytest.raises(ValueError, match="one offset each"):
        cast.flatten([a, b], flat, offsets=[0])
    with pytest.raises(TypeError, match="float32 <-> bfloat16"):
        cast.flatten([a.double()], torch.empty(4, dtype=torch.bfloat16))
