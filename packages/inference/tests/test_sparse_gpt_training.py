"""A tiny GPT trains with `SparseSelfAttention` in place of its dense causal attention.

With a layout that keeps every past block, the training run is the dense model's, step for
step; with a sparse layout (fixed windows + global blocks) the loss still falls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from minispeed.inference.sparse import FixedSparsityConfig, SparseSelfAttention, SparsityConfig

pytestmark = pytest.mark.timeout(400)


class _SparseCausalAttention(nn.Module):
    """examples/gpt.py's CausalSelfAttention with its SDPA call swapped for the sparse module."""

    def __init__(self, dense: nn.Module, config: SparsityConfig) -> None:
        super().__init__()
        self.n_head, self.qkv, self.proj = dense.n_head, dense.qkv, dense.proj
        self.attn = SparseSelfAttention(config, max_seq_length=256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.attn(q, k, v)  # (B, nh, T, hd)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


def _sparsify(model: nn.Module, config: SparsityConfig) -> nn.Module:
    model = copy.deepcopy(model)
    for block in model.blocks:
        block.attn = _SparseCausalAttention(block.attn, config)
    return model


def _train(model: nn.Module, batches, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def tiny_gpt(gpt_module):
    torch.manual_seed(0)
    cfg = gpt_module.GPTConfig(vocab_size=32, block_size=64, n_layer=2, n_head=3, n_embd=48)
    model = gpt_module.GPT(cfg)
    gen = torch.Generator().manual_seed(1)
    # A learnable stream: token t+1 = (token t + 1) mod 32 from a random start, per sequence.
    starts = torch.randint(0, 32, (6, 4, 1), generator=gen)
    seqs = (starts + torch.arange(65)) % 32
    batches = [(s[:, :-1], s[:, 1:]) for s in seqs]
    return model, batches


def test_a_layout_keeping_every_past_block_trains_exactly_like_dense(tiny_gpt, rel_close):
    model, batches = tiny_gpt
    all_past = FixedSparsityConfig(3, block=16, num_local_blocks=4, attention="unidirectional")
    dense_losses = _train(copy.deepcopy(model), batches, 4)
    sparse_losses = _train(_sparsify(model, all_past), batches, 4)
    rel_close(torch.tensor(sparse_losses), torch.tensor(dense_losses))


def test_a_sparse_layout_trains_a_tiny_gpt(tiny_gpt):
    model, batches = tiny_gpt
    sparse = FixedSparsityConfig(3, block=4, num_local_blocks=4, attention="unidirectional")
    assert sparse.make_layout(64).float().mean() == 0.25  # a quarter of the tiles
    losses = _train(_sparsify(model, sparse), batches, 30)
    assert losses[-1] < 0.25 * losses[0], losses
