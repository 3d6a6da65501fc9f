"""Helpers for the checkpoint and memory tests: build a sharded TinyGPT, train it, read it back."""

from __future__ import annotations

import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.comm as comm
import minispeed.zero as zero

GLOBAL_BATCH = 4
STEPS = 6
LR = 1e-2


def batches():
    """The same STEPS global batches everywhere (GLOBAL_BATCH divides by 1, 2 and 4)."""
    return make_batches(STEPS, GLOBAL_BATCH)


def build(
    stage: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    extras: bool = False,
    **model_kwargs,
):
    """A TinyGPT with AdamW under ZeRO ``stage``; returns (model, opt).

    ``extras``: also a second name for the tied embedding (``lm_head.weight``, a real alias that
    ``state_dict()`` lists twice) and an integer buffer, as real models have.
    """
    model = make_model(seed, **model_kwargs)
    if extras:
        model.lm_head = torch.nn.Linear(
            model.wte.weight.shape[1], model.wte.weight.shape[0], bias=False
        )
        model.lm_head.weight = model.wte.weight
        model.register_buffer("tokens_seen", torch.tensor(1234 + seed, dtype=torch.int64))
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    config = zero.ZeroConfig(stage=stage, reduce_bucket_numel=2000, allgather_bucket_numel=2000)
    precision = zero.MixedPrecision(param_dtype=dtype)
    return model, zero.shard(model, inner, config=config, precision=precision)


def train(model, opt, rank: int, world_size: int, steps: range) -> list[float]:
    """Train on global batches ``steps``; returns each step's loss averaged over all ranks."""
    data = batches()
    losses = []
    for s in steps:
        idx, tgt = rank_slice(data[s], rank, world_size)
        loss = model(idx, tgt)
        opt.backward(loss)
        opt.step()
        mean = loss.detach().float().reshape(1).clone()
        comm.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses


def reference_losses(steps: int = STEPS) -> list[float]:
    """The same training in one process with plain PyTorch: the continuous run."""
    model = make_model(0)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses = []
    for idx, tgt in batches()[:steps]:
        loss = model(idx, tgt)
        loss.backward()
        inner.step()
        inner.zero_grad()
        losses.append(loss.item())
    return losses


def model_state(model) -> dict[str, torch.Tensor]:
    """The model's fp32 state_dict on the CPU (to return from a rank)."""
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}
