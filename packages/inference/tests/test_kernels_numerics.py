"""Each fused kernel (C++ op at this machine's SIMD level) equals its PyTorch reference, fp32 ≤ 1e-5."""

from __future__ import annotations

import pytest
import torch

from minispeed.inference import kernels
from minispeed.inference.kernels import reference
from minispeed.inference.quantize import quantize_per_channel

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def op():
    op = kernels.load_op()
    if op is None:
        pytest.skip("the inference_kernels op cannot be built here; the reference is all there is")
    return op


SHAPES = [(1, 7), (5, 33), (3, 4, 130), (17, 257)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_with_residual_matches_reference(shape, with_residual, rel_close):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = torch.randn(shape, generator=g) * 3 + 1
    r = torch.randn(shape, generator=g) if with_residual else None
    w, b = torch.randn(shape[-1], generator=g), torch.randn(shape[-1], generator=g)
    out, h = kernels.layer_norm(x, w, b, 1e-5, residual=r)
    ref_out, ref_h = reference.layer_norm(x, w, b, 1e-5, residual=r)
    rel_close(out, ref_out)
    assert torch.equal(h, ref_h)  # one fp32 add: bitwise


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_with_residual_matches_reference(shape, rel_close):
    g = torch.Generator().manual_seed(shape[-1])
    x, r = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    out, h = kernels.rms_norm(x, w, 1e-6, residual=r)
    ref_out, ref_h = reference.rms_norm(x, w, 1e-6, residual=r)
    rel_close(out, ref_out)
    assert torch.equal(h, ref_h)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_matches_reference(shape, approximate, rel_close):
    g = torch.Generator().manual_seed(shape[0])
    x, b = torch.randn(shape, generator=g) * 4, torch.randn(shape[-1], generator=g)
    want = torch.nn.functional.gelu(x + b, approximate=approximate)
    rel_close(reference.bias_gelu(x, b, approximate), want)
    rel_close(kernels.bias_gelu(x, b, approximate), want)


# (rows, N, K): a decode row, odd widths (vector tails in N and K), the most rows in one pass.
LINEAR_CASES = [(1, 7, 9), (2, 37, 19), (3, 130, 33), (5, 200, 64), (8, 257, 130), (8, 64, 2)]


@pytest.mark.parametrize("rows,N,K", LINEAR_CASES)
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_reads_either_weight_layout_and_equals_f_linear(rows, N, K, layout, with_bias,
                                                               rel_close):  # fmt: skip
    g = torch.Generator().manual_seed(rows * N + K)
    x = torch.randn(rows, 1, K, generator=g)  # (B, T=1, K): a decode step's activations
    w = torch.randn(N, K, generator=g)
    if layout == "kn":  # Hugging Face's Conv1D storage (K, N), seen as its transpose
        w = w.t().contiguous().t()
        assert w.stride() == (1, N)
    b = torch.randn(N, generator=g) if with_bias else None
    got = kernels.linear(x, w, b)
    assert got.shape == (rows, 1, N)
    rel_close(got, torch.nn.functional.linear(x, w, b))


def test_linear_beyond_its_rows_or_layouts_is_torch_exactly():
    g = torch.Generator().manual_seed(0)
    op_rows = kernels.load_op().linear_max_rows
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    many = torch.randn(op_rows + 1, 24, generator=g)  # a prefill: torch's GEMM
    assert torch.equal(kernels.linear(many, w, b), torch.nn.functional.linear(many, w, b))
    strided = torch.randn(40, 48, generator=g)[:, ::2]  # neither layout the op reads
    x = torch.randn(1, 24, generator=g)
    assert torch.equal(kernels.linear(x, strided), torch.nn.functional.linear(x, strided))


@pytest.mark.parametrize("rows,N,K", LINEAR_CASES)
def test_linear_many_is_each_weights_linear_and_swiglu_its_reference(rows, N, K, rel_close):
    g = torch.Generator().manual_seed(rows * N + K + 1)
    x = torch.randn(rows, 1, K, generator=g)
    ws = [torch.randn(N + i, K, generator=g) for i in range(3)]  # q, k, v: different widths
    bs = [None, torch.randn(N + 1, generator=g), None]
    for got, w, b in zip(kernels.linear_many(x, ws, bs), ws, bs, strict=True):
        assert torch.equal(got, kernels.linear(x, w, b))  # same sums, one call
        rel_close(got, torch.nn.functional.linear(x, w, b))
    gate, up, bias = ws[0], torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    rel_close(kernels.swiglu(x, gate, up, bias, None), reference.swiglu(x, gate, up, bias, None))


def test_linear_many_and_swiglu_beyond_decode_rows_are_their_references_exactly():
    g = torch.Generator().manual_seed(3)
    many = torch.randn(kernels.load_op().linear_max_rows + 1, 24, generator=g)
    gate, up = torch.randn(40, 24, generator=g), torch.randn(40, 24, generator=g)
    assert torch.equal(kernels.swiglu(many, gate, up), reference.swiglu(many, gate, up))
    got = kernels.linear_many(many, [gate, up])
    assert all(torch.equal(a, b) for a, b in zip(got, reference.linear_many(many, [gate, up])))


@pytest.mark.parametrize("shape", [(3, 5, 9), (2, 3, 33, 33), (1, 1)])
def test_masked_softmax_matches_reference_and_zeroes_fully_masked_rows(shape, rel_close):
    g = torch.Generator().manual_seed(sum(shape))
    s = torch.randn(shape, generator=g) * 5
    mask = torch.rand(shape, generator=g) > 0.3
    mask[..., 0, :] = False  # one fully masked row
    got = kernels.masked_softmax(s, mask, scale=0.37)
    want = reference.masked_softmax(s, mask, scale=0.37)
    rel_close(got, want)
    assert torch.all(got[..., 0, :] == 0)
    causal = torch.ones(shape[-2:], dtype=torch.bool).tril()
    rel_close(kernels.masked_softmax(s, causal), reference.masked_softmax(s, causal))


@pytest.mark.parametrize("T,H,D", [(1, 1, 2), (7, 3, 10), (13, 5, 64)])
def test_rotary_embedding_matches_reference(T, H, D, rel_close):
    g = torch.Generator().manual_seed(T * H * D)
    cos, sin = kernels.rotary_tables(50, D)
    x = torch.randn(T, H, D, generator=g)
    pos = torch.randint(0, 50, (T,), generator=g)
    rel_close(
        kernels.rotary_embedding(x, pos, cos, sin), reference.rotary_embedding(x, pos, cos, sin)
    )


# (B, H query heads, KV cached heads, D, block_size): multi-head (KV = H) and grouped-query.
DECODE_CASES = [(1, 1, 1, 8, 4), (3, 4, 4, 17, 5), (5, 2, 2, 64, 16), (3, 6, 2, 17, 5),
                (2, 4, 1, 64, 16)]  # fmt: skip


@pytest.mark.parametrize("B,H,KV,D,block_size", DECODE_CASES)
def test_decode_attention_matches_reference_over_scattered_blocks(B, H, KV, D, block_size,
                                                                  rel_close):  # fmt: skip
    g = torch.Generator().manual_seed(B * H * D)
    num_blocks, max_blocks = 3 * B + 4, 3
    k = torch.randn(num_blocks, block_size, KV, D, generator=g)
    v = torch.randn(num_blocks, block_size, KV, D, generator=g)
    q = torch.randn(B, H, D, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: B * max_blocks].view(B, max_blocks)
    lens = torch.randint(1, max_blocks * block_size + 1, (B,), generator=g)
    got = kernels.decode_attention(q, k, v, tables, lens)
    want = reference.decode_attention(q, k, v, tables, lens)
    rel_close(got, want)
    # the naive dense attention on the first sequence, as a third opinion
    n = int(lens[0])
    t = torch.arange(n)
    kd, vd = (
        k[tables[0, t // block_size], t % block_size],
        v[tables[0, t // block_size], t % block_size],
    )
    dense = torch.nn.functional.scaled_dot_product_attention(
        q[0][:, None], kd.transpose(0, 1), vd.transpose(0, 1), enable_gqa=True
    )[:, 0]
    rel_close(got[0], dense)


def test_decode_attention_names_query_heads_that_do_not_group_over_the_cache():
    q, cache = torch.randn(1, 5, 8), torch.randn(2, 4, 2, 8)  # 5 query heads over 2 cached
    with pytest.raises(ValueError, match="5 query heads a multiple of KV"):
        kernels.decode_attention(q, cache, cache, torch.zeros(1, 1), torch.tensor([1]))


@pytest.mark.parametrize("M,N,K", [(1, 7, 9), (3, 33, 65), (16, 40, 257)])
def test_int8_linear_matches_reference_and_the_quantization_bound(M, N, K, rel_close):
    g = torch.Generator().manual_seed(M * N * K)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x = torch.randn(M, K, generator=g)
    q, s = quantize_per_channel(w)
    got = kernels.int8_linear(x, q, s, b)
    rel_close(got, reference.int8_linear(x, q, s, b))
    # Round-to-nearest leaves |w - q·s| ≤ s/2 per weight, so |y - y_fp32| ≤ (s/2) · Σ|x|.
    bound = (s[None, :] / 2) * x.abs().sum(-1, keepdim=True)
    err = (got - torch.nn.functional.linear(x, w, b)).abs()
    assert torch.all(err <= bound * (1 + 1e-4) + 1e-5)


def test_int8_linear_reads_every_row_count_and_channel_tail_alike(rel_close):
    # The kernel has one register-blocked form per row count 1-8 (a prefill runs in chunks of 8),
    # output channels in thread tasks of 64 (300 = 4 tasks + a tail of 44) and a K tail (260 is
    # not a multiple of 16); the weight (78,000 bytes) is large enough for threads.
    g = torch.Generator().manual_seed(11)
    q, s = quantize_per_channel(torch.randn(300, 260, generator=g))
    b, x = torch.randn(300, generator=g), torch.randn(19, 260, generator=g)
    full = kernels.int8_linear(x, q, s, b)
    rel_close(full, reference.int8_linear(x, q, s, b))
    for rows in range(1, 9):  # a row's output does not depend on how many rows share the call
        assert torch.equal(kernels.int8_linear(x[:rows], q, s, b), full[:rows]), rows


def test_argmax_is_torchs_on_ties_infinities_and_nans():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 50257, generator=g)
    x[1, [9, 4000, 50256]] = 40.0  # ties: the first index
    x[2, :] = -float("inf")  # all -inf: index 0
    x[3, [77, 3]] = float("nan")  # NaN is the largest: the first NaN
    x[4, 0] = float("nan")
    x[5, [10, 20]] = float("inf")
    assert torch.equal(kernels.argmax(x), x.argmax(-1))
    assert torch.equal(kernels.argmax(x[:, :1]), torch.zeros(6, dtype=torch.int64))
    y = torch.randn(2, 3, 257, generator=g)  # leading dims kept, a vector-unfriendly width
    assert torch.equal(kernels.argmax(y), reference.argmax(y))
    assert kernels.argmax(x[0]).shape == ()


def test_unsupported_dtype_is_a_clear_error():
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"float32.*\.float\(\)"):
        kernels.layer_norm(x, torch.ones(8), None)


def test_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="residual has shape"):
        kernels.layer_norm(torch.randn(2, 8), torch.ones(8), None, residual=torch.randn(2, 7))
    with pytest.raises(ValueError, match="block ids"):
        kernels.decode_attention(
            torch.randn(1, 1, 4), torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4),
            torch.tensor([[5]]), torch.tensor([1]),
        )  # fmt: skip
