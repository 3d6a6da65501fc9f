"""The block-sparse attention op equals dense attention under the same mask, values and grads.

Every layout mode, causal and not, odd head counts and head dims, blocks from 8 to 80 tokens,
sequence lengths that are multiples of the block; fp32 within 1e-5 (relative to the largest value). This runs the widest
SIMD level the CPU has; test_sparse_simd_paths.py runs the scalar build.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minispeed.inference.kernels import InferenceKernelsBuilder
from minispeed.inference.sparse import (
    BigBirdSparsityConfig,
    BlockSparseLayout,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparseSelfAttention,
    VariableSparsityConfig,
    block_sparse_attention,
    sparse_attention_reference,
)
from minispeed.inference.sparse.attention import _load_sparse_op

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def op():
    ok, why = InferenceKernelsBuilder().is_compatible()
    if not ok:
        pytest.skip(f"inference_kernels cannot be built here: {why}")
    loaded = _load_sparse_op()
    if loaded is None:
        pytest.skip("the op build failed; see python -m minispeed.core.report")
    return loaded


def _configs(heads: int, block: int, direction: str):
    yield DenseSparsityConfig(heads, block)
    yield FixedSparsityConfig(heads, block, num_local_blocks=2, attention=direction)
    yield VariableSparsityConfig(heads, block, True, num_random_blocks=1,
                                 local_window_blocks=(1, 2), attention=direction)  # fmt: skip
    yield BigBirdSparsityConfig(heads, block, True, num_random_blocks=1, attention=direction)
    yield BSLongformerSparsityConfig(heads, block, global_block_indices=(1,), attention=direction)
    yield LocalSlidingWindowSparsityConfig(heads, block, attention=direction)


def _grads(out, inputs, seed):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("direction", ["bidirectional", "unidirectional"])
@pytest.mark.parametrize(
    ("batch", "heads", "seq", "dim", "block"),
    # odd dims and small blocks (every vector tail), blocks of 40 and 48 (the softmax's groups
    # of two and three vectors at AVX-512), then blocks and dims of 64 and 80 (the widest
    # register tiles of the op's matrix products, and their edges)
    [
        (2, 3, 48, 19, 8),
        (1, 5, 64, 33, 16),
        (1, 2, 120, 24, 40),
        (1, 1, 144, 40, 48),
        (1, 2, 256, 64, 64),
        (1, 1, 240, 70, 80),
    ],
)
def test_every_layout_matches_dense_attention_under_its_mask(
    op, rel_close, direction, batch, heads, seq, dim, block
):
    gen = torch.Generator().manual_seed(seq + heads)
    q, k, v = (
        torch.randn(batch, heads, seq, dim, generator=gen, requires_grad=True) for _ in range(3)
    )
    for cfg in _configs(heads, block, direction):
        layout = cfg.make_layout(seq)
        causal = cfg.causal
        got = block_sparse_attention(q, k, v, layout, block, causal=causal)
        assert got.grad_fn is not None and "BlockSparseAttention" in type(got.grad_fn).__name__
        want = sparse_attention_reference(q, k, v, layout, block, causal=causal)
        rel_close(got, want)
        for a, b in zip(_grads(got, (q, k, v), 1), _grads(want, (q, k, v), 1), strict=True):
            rel_close(a, b)


def test_dense_causal_layout_equals_torch_sdpa(op, rel_close):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 32, 16, generator=gen, requires_grad=True) for _ in range(3))
    attn = SparseSelfAttention(DenseSparsityConfig(3, block=8), max_seq_length=64)
    attn.sparsity_config = FixedSparsityConfig(3, 8, num_local_blocks=4, attention="unidirectional")
    got = attn(q, k, v)  # 4 blocks in one causal window: every past key kept
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rel_close(got, want)
    for a, b in zip(_grads(got, (q, k, v), 2), _grads(want, (q, k, v), 2), strict=True):
        rel_close(a, b)


def test_a_custom_scale_and_a_prebuilt_layout(op, rel_close):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 24, 7, generator=gen) for _ in range(3))
    layout = torch.rand(2, 3, 3, generator=gen) > 0.4
    layout[:, torch.arange(3), torch.arange(3)] = True
    csr = BlockSparseLayout.from_layout(layout, 8)
    assert csr.density == pytest.approx(layout.float().mean().item())
    rel_close(
        block_sparse_attention(q, k, v, csr, scale=0.3),
        sparse_attention_reference(q, k, v, layout, 8, scale=0.3),
    )


def test_bad_inputs_raise_with_the_fix():
    attn = SparseSelfAttention(FixedSparsityConfig(2, block=16), max_seq_length=128)
    x = torch.randn(1, 2, 40, 8)
    with pytest.raises(
        ValueError, match=r"40 is not a multiple of the sparsity block 16: pad .* by 8"
    ):
        attn(x, x, x)
    with pytest.raises(ValueError, match="query has 3 heads but the sparsity config 2"):
        y = torch.randn(1, 3, 32, 8)
        attn(y, y, y)
    with pytest.raises(ValueError, match="exceeds max_seq_length 128"):
        y = torch.randn(1, 2, 256, 8)
        attn(y, y, y)
    layout = FixedSparsityConfig(2, block=16).make_layout(64)
    with pytest.raises(ValueError, match="layout is for 2 heads and 64 tokens"):
        y = torch.randn(1, 2, 32, 8)
        block_sparse_attention(y, y, y, layout, 16)
    with pytest.raises(TypeError, match=r"takes float32.*call \.float\(\)"):
        y = torch.randn(1, 2, 64, 8, dtype=torch.float64)
        block_sparse_attention(y, y, y, layout, 16)
    with pytest.raises(ValueError, match="pass block="):
        block_sparse_attention(x, x, x, layout)
    with pytest.raises(ValueError, match=r"scale must be > 0"):
        y = torch.randn(1, 2, 64, 8)
        block_sparse_attention(y, y, y, layout, 16, scale=-0.5)


def test_with_the_op_disabled_the_reference_runs_and_trains(monkeypatch, rel_close):
    monkeypatch.setenv("MINISPEED_DISABLE_OPS", "inference_kernels")
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 3, 32, 5, generator=gen, requires_grad=True) for _ in range(3))
    layout = LocalSlidingWindowSparsityConfig(3, block=8).make_layout(32)
    got = block_sparse_attention(q, k, v, layout, 8, causal=True)
    assert "BlockSparseAttention" not in type(got.grad_fn).__name__  # plain autograd
    rel_close(got, sparse_attention_reference(q, k, v, layout, 8, causal=True))
    got.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
