"""`seq_all_to_all` on 2 and 4 gloo ranks: forward and backward equal a single-process reference
built from every rank's tensor (bit for bit: an all-to-all moves values, it adds nothing), each
call logs one all-to-all of numel · itemsize · (P-1)/P bytes sent, and bad input raises a clear
error on every rank."""

from __future__ import annotations

import pytest
import torch

import minispeed.comm as comm
import minispeed.tensor_parallel as tp
from minispeed.core.testing import DistributedTestError, run_distributed

pytestmark = pytest.mark.timeout(300)

SHAPE = (4, 4, 8, 3)  # (B, T/P, H, D): every dim but D divisible by 4
DIMS = [(2, 1), (1, 2), (0, 3), (-2, -3)]  # (scatter, gather): heads in, sequence out, others


def _x(rank: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(10 + rank))


def _g(rank: int, shape: torch.Size) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


def _body(rank: int, world_size: int) -> dict:
    out = {}
    for scatter, gather in DIMS:
        x = _x(rank).requires_grad_(True)
        with comm.CommsLogger() as log:
            y = tp.seq_all_to_all(x, None, scatter, gather)
            y.backward(_g(rank, y.shape))
        sent = tp.seq_all_to_all_bytes(x, world_size)
        out[scatter, gather] = (y.detach(), x.grad, [r.wire_bytes for r in log.records], sent)
    return out


def _reference(n: int, scatter: int, gather: int) -> tuple[list, list]:
    """Every rank's output and input gradient, in one process: rank r's output is chunk r (along
    `scatter`) of every rank's x, concatenated along `gather`; autograd gives the gradients."""
    xs = [_x(k).requires_grad_(True) for k in range(n)]
    ys = [torch.cat([x.chunk(n, scatter)[r] for x in xs], gather) for r in range(n)]
    sum((y * _g(r, y.shape)).sum() for r, y in enumerate(ys)).backward()
    return [y.detach() for y in ys], [x.grad for x in xs]


@pytest.mark.parametrize("world_size", [2, 4])
def test_seq_all_to_all_matches_the_single_process_reference(world_size):
    results = run_distributed(_body, world_size=world_size)
    for scatter, gather in DIMS:
        ys, grads = _reference(world_size, scatter, gather)
        for r, got in enumerate(results):
            y, grad, wire, sent = got[scatter, gather]
            assert torch.equal(y, ys[r]), (scatter, gather, r)
            assert torch.equal(grad, grads[r]), (scatter, gather, r)
            # one all-to-all forward, its inverse backward, each (P-1)/P of the tensor
            want = 4 * 4 * 4 * 8 * 3 * (world_size - 1) // world_size
            assert sent == want and wire == [want, want], (wire, want)


def _indivisible(rank: int, world_size: int) -> str:
    try:
        tp.seq_all_to_all(torch.zeros(2, 3, 5), None, scatter_dim=1, gather_dim=0)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_indivisible_dim_is_refused_on_every_rank_naming_the_sizes():
    for msg in run_distributed(_indivisible, world_size=2):
        assert "size 3, not divisible by the sequence-parallel size 2" in msg, msg
        assert "multiple of 2" in msg


def _mismatched(rank: int, world_size: int) -> None:
    x = torch.zeros(2, 4, 6 if rank == 0 else 8)  # rank 1's rows are wider
    tp.seq_all_to_all(x, None, scatter_dim=0, gather_dim=1)


def test_mismatched_shapes_across_ranks_are_refused_not_hung():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_mismatched, world_size=2, timeout_s=60)
    text = str(info.value)
    assert "all_to_all" in text and "row=(1, 4, 6)" in text and "row=(1, 4, 8)" in text, text


# -- DistributedAttention: whole-sequence attention from each rank's tokens -----------------------
B, T, H, D = 2, 8, 4, 4  # T and H divisible by 2 and 4


class _Causal(torch.nn.Module):
    """Local attention on (B, T, H, D) or (T, B, H, D), causal over the whole sequence."""

    def __init__(self, batch_dim_idx: int) -> None:
        super().__init__()
        self.batch_dim_idx = batch_dim_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        to, back = (
            ((0, 2, 1, 3), (0, 2, 1, 3))
            if self.batch_dim_idx == 0
            else ((1, 2, 0, 3), (2, 0, 1, 3))
        )
        q, k, v = (t.permute(to) for t in (q, k, v))  # (B, H, T, D)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.permute(back)


def _qkv(batch_dim_idx: int) -> list[torch.Tensor]:
    """Whole-sequence q, k, v in the layout `batch_dim_idx` says."""
    g = torch.Generator().manual_seed(3)
    shape = (B, T, H, D) if batch_dim_idx == 0 else (T, B, H, D)
    return [torch.randn(shape, generator=g) for _ in range(3)]


def _rope() -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-DeepSpeed's (cos, sin), shape (1, T, 1, D): rotary over all D channels."""
    angle = torch.arange(T)[:, None] * torch.tensor([1.0, 0.1])[None, :]  # (T, D/2)
    angle = torch.cat((angle, angle), -1)[None, :, None, :]
    return angle.cos(), angle.sin()


def _attention_body(rank: int, world_size: int, batch_dim_idx: int, rope: bool) -> tuple:
    seq_dim = 1 - batch_dim_idx
    full = _qkv(batch_dim_idx)
    mine = [t.chunk(world_size, seq_dim)[rank].clone().requires_grad_(True) for t in full]
    attn = tp.DistributedAttention(_Causal(batch_dim_idx), None)
    with comm.CommsLogger() as log:
        out = attn(*mine, batch_dim_idx, _rope() if rope else None)
        out.backward(torch.ones_like(out) * (rank + 1))
    return out.detach(), [t.grad for t in mine], len(log.filter(op="all_to_all"))


@pytest.mark.parametrize(("batch_dim_idx", "rope"), [(0, False), (1, True)])
def test_distributed_attention_equals_attention_on_the_whole_sequence(batch_dim_idx, rope):
    n, seq_dim = 2, 1 - batch_dim_idx
    got = run_distributed(_attention_body, world_size=n, args=(batch_dim_idx, rope))
    # the reference: one process, the whole sequence, the same rotary and causal attention
    full = [t.requires_grad_(True) for t in _qkv(batch_dim_idx)]
    q, k, v = full
    if rope:
        cos, sin = (f.permute(1, 0, 2, 3) for f in _rope())  # (T, 1, 1, D)

        def rotate(t):
            a, b = t.chunk(2, -1)
            return t * cos + torch.cat((-b, a), -1) * sin

        q, k = rotate(q), rotate(k)
    want = _Causal(batch_dim_idx)(q, k, v)
    weights = torch.cat(
        [torch.full_like(c, r + 1.0) for r, c in enumerate(want.chunk(n, seq_dim))], seq_dim
    )
    (want * weights).sum().backward()
    for r, (out, grads, calls) in enumerate(got):
        # fp32 attention on the same values, heads computed apart: sums in another order only
        torch.testing.assert_close(out, want.detach().chunk(n, seq_dim)[r], rtol=1e-5, atol=1e-6)
        for g, t in zip(grads, full):
            torch.testing.assert_close(g, t.grad.chunk(n, seq_dim)[r], rtol=1e-5, atol=1e-6)
        assert calls == 8  # q, k, v, out forward; their inverses backward


class _GroupedCausal(torch.nn.Module):
    """Causal attention on (B, T, H, D) whose key/value heads serve H / K query heads each."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2)


def _grouped_qkv(heads: int, kv_heads: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(B, T, h, D, generator=g) for h in (heads, kv_heads, kv_heads)]


def _uneven_body(rank: int, world_size: int, heads: int, kv_heads: int) -> tuple:
    mine = [
        t.chunk(world_size, 1)[rank].clone().requires_grad_(True)
        for t in _grouped_qkv(heads, kv_heads)
    ]
    attn = tp.DistributedAttention(_GroupedCausal(), None)
    out = attn(*mine, 0)
    out.backward(torch.ones_like(out) * (rank + 1))
    return out.detach(), [t.grad for t in mine]


@pytest.mark.parametrize(
    ("world_size", "heads", "kv_heads"),
    [(2, 3, 3), (2, 6, 3), (4, 10, 5)],
    ids=["3-heads-over-2", "6-over-3-kv-over-2", "10-over-5-kv-over-4"],
)
def test_uneven_heads_equal_attention_on_the_whole_sequence(world_size, heads, kv_heads):
    """P does not divide the key/value heads: ranks take whole key/value groups (DeepSpeed's
    split, `head_shares`), and every rank's output and gradients are its tokens' of the
    single-process attention."""
    got = run_distributed(_uneven_body, world_size=world_size, args=(heads, kv_heads))
    full = [t.requires_grad_(True) for t in _grouped_qkv(heads, kv_heads)]
    want = _GroupedCausal()(*full)
    weights = torch.cat(
        [torch.full_like(c, r + 1.0) for r, c in enumerate(want.chunk(world_size, 1))], 1
    )
    (want * weights).sum().backward()
    for r, (out, grads) in enumerate(got):
        # fp32 attention on the same values, heads computed apart: sums in another order only
        torch.testing.assert_close(out, want.detach().chunk(world_size, 1)[r], rtol=1e-5, atol=1e-6)
        for g, t in zip(grads, full, strict=True):
            torch.testing.assert_close(g, t.grad.chunk(world_size, 1)[r], rtol=1e-5, atol=1e-6)


def test_head_shares_deal_key_value_groups_lowest_ranks_first():
    assert tp.head_shares(3, 3, 2) == [2, 1]
    assert tp.head_shares(6, 3, 2) == [4, 2]  # query heads follow their key/value head
    assert tp.head_shares(7, 7, 4) == [2, 2, 2, 1]


def _refused(rank: int, world_size: int, heads: int, kv_heads: int) -> str:
    attn = tp.DistributedAttention(_GroupedCausal(), None)
    q, k, v = (t.chunk(world_size, 1)[rank] for t in _grouped_qkv(heads, kv_heads))
    try:
        attn(q, k, v, 0)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("heads", "kv_heads", "says"),
    [
        (4, 1, "1 key/value heads are fewer than the sequence-parallel size 2"),
        (4, 3, "4 heads are not a multiple of the 3 key/value heads"),
    ],
    ids=["fewer-kv-heads-than-ranks", "query-heads-not-grouped"],
)
def test_bad_head_counts_are_refused_naming_them(heads, kv_heads, says):
    for msg in run_distributed(_refused, world_size=2, args=(heads, kv_heads)):
        assert says in msg, msg
