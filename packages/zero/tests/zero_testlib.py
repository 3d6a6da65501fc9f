"""A tiny GPT for ZeRO's tests: every awkward parameter shape real models have, in ~80 lines.

- tied embeddings: ``wte.weight`` is both the token embedding and the output projection;
- a parameter used twice in one forward: ``shared_gain`` scales the input of every block;
- a parameter never used: ``unused`` (its gradient stays ``None`` in plain PyTorch);
- odd sizes (vocab 67, width 24) so that flat partitions need padding for any world size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(
        self,
        vocab: int = 67,
        width: int = 24,
        heads: int = 2,
        layers: int = 2,
        block_size: int = 16,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block_size, width)
        self.shared_gain = nn.Parameter(torch.ones(width))  # used by every block: twice per forward
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.unused = nn.Parameter(torch.randn(5))  # never touched by forward
        self.block_size = block_size

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=idx.device), diagonal=1)
        for block in self.blocks:
            x = block(x * self.shared_gain, mask)
        logits = self.ln_f(x) @ self.wte.weight.t()  # tied output projection: (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(seed: int = 0, **kwargs) -> TinyGPT:
    """The same initial weights on every rank and in the single-process reference."""
    torch.manual_seed(seed)
    return TinyGPT(**kwargs)


def make_batches(
    steps: int, global_batch: int, seed: int = 1, vocab: int = 67, block_size: int = 16
):
    """``steps`` global batches of (idx, targets), each (global_batch, block_size) int64."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (steps, global_batch, block_size + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def rank_slice(batch, rank: int, world_size: int):
    """This rank's contiguous share of a global batch (global_batch must divide by world_size)."""
    idx, tgt = batch
    n = idx.shape[0] // world_size
    return idx[rank * n : (rank + 1) * n], tgt[rank * n : (rank + 1) * n]
