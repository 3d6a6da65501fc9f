"""zero.checkpoint inside ZeRO stages 2 and 3: the same losses as without it, bit for bit, with a
parameter (``shared_gain``) used inside every checkpointed block."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed


def _checkpointed_forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """TinyGPT's forward with each block, shared gain included, under zero.checkpoint."""
    T = idx.shape[1]
    x = self.wte(idx) + self.wpe(torch.arange(T))
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    for block in self.blocks:
        x = zero.checkpoint(lambda h, m, block=block: block(h * self.shared_gain, m), x, mask)
    logits = self.ln_f(x) @ self.wte.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _losses(rank: int, world_size: int, stage: int, ckpt: bool) -> list[float]:
    model = make_model(0)
    if ckpt:
        model.forward = types.MethodType(_checkpointed_forward, model)
    config = zero.ZeroConfig(stage=stage, stage3_param_persistence_threshold_numel=30)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    losses = []
    for batch in make_batches(3, 4):
        loss = model(*rank_slice(batch, rank, world_size))
        opt.backward(loss)
        opt.step()
        losses.append(loss.item())
    return losses


def _body(rank: int, world_size: int) -> dict[int, tuple[list[float], list[float]]]:
    return {
        s: (_losses(rank, world_size, s, False), _losses(rank, world_size, s, True)) for s in (2, 3)
    }


def test_checkpointed_blocks_train_exactly_like_plain_ones_under_zero():
    for per_stage in run_distributed(_body, world_size=2, timeout_s=120):
        for plain, checkpointed in per_stage.values():
            assert checkpointed == plain
