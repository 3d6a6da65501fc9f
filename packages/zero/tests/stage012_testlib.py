"""Helpers for the stage 0-2 and precision tests: one training loop for ZeRO, one for plain PyTorch.

Data: ``STEPS`` global batches of ``GLOBAL_BATCH`` sequences. With N ranks and A accumulation
steps, global batch b is cut into N·A equal micro-batches; rank r takes micro-batches
r·A .. r·A + A - 1. Every micro-batch has the same number of tokens, so the mean of the N·A
micro-batch losses is the global-batch loss plain PyTorch computes in one forward.
"""

from __future__ import annotations

import functools

import torch
from zero_testlib import make_batches, make_model

import minispeed.comm as comm
import minispeed.zero as zero

STEPS = 20
GLOBAL_BATCH = 8


def make_optimizer(params, kind: str) -> torch.optim.Optimizer:
    """The optimizers the numerics tests cover (weight decay on, so unused params would show)."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    raise ValueError(kind)


def micro_batches(batch, rank: int, world_size: int, accumulation: int):
    """This rank's ``accumulation`` micro-batches of one global batch."""
    idx, tgt = batch
    k = idx.shape[0] // (world_size * accumulation)
    first = rank * accumulation
    return [
        (idx[(first + j) * k : (first + j + 1) * k], tgt[(first + j) * k : (first + j + 1) * k])
        for j in range(accumulation)
    ]


@functools.cache
def reference_run(kind: str, max_grad_norm: float = 0.0, steps: int = STEPS):
    """Plain single-process PyTorch on the global batches: (losses, final weights, clipped steps).

    Cached per process (treat the result as read-only); runs on one thread like the workers.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(kind, max_grad_norm, steps)
    finally:
        torch.set_num_threads(threads)


def _reference_run(kind: str, max_grad_norm: float, steps: int):
    model = make_model()
    opt = make_optimizer(model.parameters(), kind)
    losses, clipped = [], 0
    for batch in make_batches(steps, GLOBAL_BATCH):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        if max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            clipped += int(norm > max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, clipped


def zero_run(
    rank: int,
    world_size: int,
    kind: str,
    config: zero.ZeroConfig,
    precision=None,
    steps: int = STEPS,
):
    """Train a fresh TinyGPT under ``zero.shard``: (global losses, final fp32 weights, optimizer).

    The loss of a step is the mean over every rank's micro-batches, all-reduced, so it is the
    number plain PyTorch reports for the global batch.
    """
    model = make_model()
    opt = zero.shard(
        model, make_optimizer(model.parameters(), kind), config=config, precision=precision
    )
    a = config.gradient_accumulation_steps
    losses = []
    for batch in make_batches(steps, GLOBAL_BATCH):
        total = torch.zeros(1)
        stepped = []
        for x, y in micro_batches(batch, rank, world_size, a):
            loss = model(x, y)
            opt.backward(loss)
            total += loss.detach().float() / a
            stepped.append(opt.step())
        assert stepped == [False] * (a - 1) + [True], f"step() acted at {stepped}"
        comm.all_reduce(total)
        losses.append(total.item() / world_size)
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return losses, weights, opt


def max_relative_error(losses, reference) -> float:
    """Largest |a - b| / |b| over the steps."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
