"""The permutation op (every SIMD path this CPU runs) equals the reference; autograd pairs hold."""

from __future__ import annotations

import pytest
import torch

from minispeed.core.op_builder import DISABLE_ENV, requested_simd_level
from minispeed.moe import permute as P

pytestmark = pytest.mark.timeout(300)
WIDTHS = [1, 7, 8, 15, 16, 17, 33, 100]  # below / at / above one AVX2 (8) and AVX-512 (16) vector


@pytest.fixture(scope="module")
def op():
    module = P.load_op("cpu")
    if module is None:
        pytest.skip("the moe_permute op cannot be built here (see the fallback warning)")
    return module


def test_every_runnable_simd_level_is_offered(op):
    # The AVX-512 loop is compiled into every x86 build (target attribute): it is offered only
    # where the CPU (or MINISPEED_SIMD) allows it.
    assert op.simd_levels() == list(range(int(requested_simd_level()) + 1))


@pytest.mark.parametrize("d", WIDTHS)
def test_gather_and_combine_match_reference_at_every_level(op, d):
    g = torch.Generator().manual_seed(d)
    src = torch.randn(40, d, generator=g)
    index = torch.randint(-1, 40, (57,), generator=g)
    scale = torch.randn(57, generator=g)
    pairs = torch.randint(-1, 40, (23, 3), generator=g)
    weight = torch.randn(23, 3, generator=g)
    for level in op.simd_levels():
        # A gather copies (or scales once): exact. A combine sums k products: FMA paths
        # round once per step where the reference rounds twice, so a few ulp.
        assert torch.equal(
            P.gather_rows(src, index, level=level), P.reference.gather_rows(src, index)
        )
        assert torch.equal(
            P.gather_rows(src, index, scale, level=level),
            P.reference.gather_rows(src, index, scale),
        )
        torch.testing.assert_close(
            P.combine_rows(src, pairs, weight, level=level),
            P.reference.combine_rows(src, pairs, weight),
            rtol=1e-6,
            atol=1e-6,
        )
        torch.testing.assert_close(  # no weights: plain sums of the picked rows
            P.combine_rows(src, pairs, level=level),
            P.reference.combine_rows(src, pairs),
            rtol=1e-6,
            atol=1e-6,
        )


def test_empty_inputs(op):
    assert P.gather_rows(torch.randn(0, 4), torch.empty(0, dtype=torch.int64)).shape == (0, 4)
    out = P.combine_rows(torch.randn(0, 4), torch.full((3, 2), -1))
    assert torch.equal(out, torch.zeros(3, 4))


@pytest.mark.parametrize("compiled", [True, False])
def test_bad_index_raises_not_reads_wild(op, compiled, monkeypatch):
    if not compiled:
        monkeypatch.setenv(DISABLE_ENV, "moe_permute")
    src = torch.randn(5, 8)
    with pytest.raises(IndexError, match="index 5 at position 2 is outside"):
        P.gather_rows(src, torch.tensor([0, 1, 5]))
    with pytest.raises(IndexError, match="index -3 at position 1 is outside"):
        P.combine_rows(src, torch.tensor([[0, -3]]))
    with pytest.raises(TypeError, match="int64"):
        P.gather_rows(src, torch.tensor([0, 1], dtype=torch.int32))


def _plan(num_tokens: int, k: int, seed: int):
    """A random dispatch: each (token, choice) gets a distinct slot or is dropped."""
    g = torch.Generator().manual_seed(seed)
    slots = num_tokens * k + 3
    perm = torch.randperm(slots, generator=g)[: num_tokens * k].view(num_tokens, k)
    token_slot = torch.where(torch.rand(num_tokens, k, generator=g) < 0.2, -1, perm)
    slot_token = torch.full((slots,), -1)
    tokens = torch.arange(num_tokens)[:, None].expand(num_tokens, k)
    slot_token[token_slot[token_slot >= 0]] = tokens[token_slot >= 0]
    return slot_token, token_slot


def test_permute_unpermute_gradcheck():
    slot_token, token_slot = _plan(6, 2, 0)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(slot_token.numel(), 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: P.permute(a, slot_token, token_slot), (x,))
    assert torch.autograd.gradcheck(lambda a, b: P.unpermute(a, b, token_slot, slot_token), (y, w))


def test_compiled_gradients_equal_reference_gradients(op, monkeypatch):
    slot_token, token_slot = _plan(50, 2, 1)

    def run():
        torch.manual_seed(0)
        x = torch.randn(50, 24, requires_grad=True)
        w = torch.rand(50, 2, requires_grad=True)
        mid = P.permute(x, slot_token, token_slot) * 1.5
        out = P.unpermute(mid, w, token_slot, slot_token)
        out.pow(2).sum().backward()
        return out.detach(), x.grad, w.grad

    compiled = run()
    monkeypatch.setenv(DISABLE_ENV, "moe_permute")
    for a, b in zip(compiled, run()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
