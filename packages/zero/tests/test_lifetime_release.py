"""Lifetime: a sharded model and its ZeroOptimizer are freed like plain PyTorch objects.

Gradient hooks live in autograd's C++ structures, which Python's garbage collector cannot see
through, so a hook holding its optimizer strongly would keep the optimizer, its masters, its
optimizer state and its gradient buffers alive forever once the user drops them. Users rely on
``del opt, model`` freeing everything (torch's DDP / FSDP do), and on ``opt.close()`` handing
back a plain ``nn.Module`` whose backward no longer runs any ZeRO hook (and that can be sharded
again).
"""

from __future__ import annotations

import copy
import ctypes
import gc
import weakref

import torch
from stage012_testlib import micro_batches
from zero_testlib import make_batches, make_model

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

STAGES = (0, 1, 2, 3)


def _train(stage: int, rank: int, world_size: int):
    """A TinyGPT sharded at ``stage``, trained two steps; returns (model, opt)."""
    model = make_model()
    opt = zero.shard(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        config=zero.ZeroConfig(stage=stage, reduce_bucket_numel=500),
    )
    for batch in make_batches(2, 4):
        ((idx, tgt),) = micro_batches(batch, rank, world_size, 1)
        opt.backward(model(idx, tgt))
        opt.step()
    return model, opt


def _train_and_drop(stage: int, rank: int, world_size: int) -> list[weakref.ref]:
    model, opt = _train(stage, rank, world_size)
    refs = [weakref.ref(opt), weakref.ref(opt.strategy), weakref.ref(model)]
    del opt, model
    return refs


def _close_then_plain_backward(stage: int, rank: int, world_size: int) -> dict[str, bool]:
    model, opt = _train(stage, rank, world_size)
    opt.close()
    opt.close()  # idempotent
    (idx, tgt) = make_batches(1, 2, seed=7)[0]
    # A plain copy with the same weights: what plain PyTorch computes for this model now.
    reference = copy.deepcopy(model)
    reference.load_state_dict(model.state_dict())
    reference(idx, tgt).backward()
    micro_step, agreement = opt.micro_step, opt._agreement.clone()
    model(idx, tgt).backward()  # plain autograd: no ZeRO hook may run
    got = dict(model.named_parameters())
    grads_match = all(
        (p.grad is None) == (got[n].grad is None)
        and (p.grad is None or torch.allclose(p.grad, got[n].grad, atol=1e-6))
        for n, p in reference.named_parameters()
    )
    used_have_grads = got["wte.weight"].grad is not None and got["unused"].grad is None
    try:
        opt.backward(model(idx, tgt))
        refused = False
    except RuntimeError:
        refused = True
    model.zero_grad(set_to_none=True)
    with zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1)) as again:
        again.backward(model(idx[rank : rank + 1], tgt[rank : rank + 1]))
        resharded_steps = again.step()
    return {
        "sharded again after close": resharded_steps and again.closed,
        "grads match plain torch": grads_match,
        "grads land in .grad": used_have_grads,
        "no hook fired": opt.micro_step == micro_step and torch.equal(opt._agreement, agreement),
        "backward after close refused": refused,
    }


def _lifetime(rank: int, world_size: int):
    released = {}
    for stage in STAGES:
        refs = _train_and_drop(stage, rank, world_size)
        gc.collect()
        released[stage] = [r() is None for r in refs]
    closed = {stage: _close_then_plain_backward(stage, rank, world_size) for stage in STAGES}
    return released, closed


def test_dropped_optimizer_and_model_are_freed_and_close_restores_plain_pytorch() -> None:
    for released, closed in run_distributed(_lifetime, world_size=2, timeout_s=180):
        for stage in STAGES:
            assert released[stage] == [True, True, True], (
                f"stage {stage}: (ZeroOptimizer, strategy, model) freed after del + gc.collect(): "
                f"{released[stage]}"
            )
            assert all(closed[stage].values()), f"stage {stage} after close(): {closed[stage]}"


class _MallInfo2(ctypes.Structure):
    _NAMES = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in _NAMES.split()]


def _heap_in_use() -> int | None:
    """Bytes malloc has handed out in this process (glibc >= 2.33), or None elsewhere."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def _shard_and_drop(rank: int, world_size: int) -> list[weakref.ref]:
    model = make_model(width=256, layers=4)  # ~12.7 MB fp32: shards + grad shards ~12.7/N MB
    opt = zero.shard(model, torch.optim.AdamW(model.parameters()), config=zero.ZeroConfig(stage=3))
    return [weakref.ref(sp) for sp in opt.strategy.sharded_params()]


def _stage3_one_collection(rank: int, world_size: int) -> dict:
    _shard_and_drop(rank, world_size)  # warm-up: first use imports and caches (not per model)
    gc.collect()
    left, alive = [], []
    for _ in range(2):
        before = _heap_in_use()
        refs = _shard_and_drop(rank, world_size)
        gc.collect()  # ONE pass: what a user's `del opt, model; gc.collect()` does
        after = _heap_in_use()
        alive.append(sum(r() is not None for r in refs))
        left.append(None if before is None else after - before)
        gc.collect()  # do not let a leftover distort the next round
    return {"alive": alive, "left": left}


def test_stage3_shards_are_freed_by_one_collection() -> None:
    """A dropped stage-3 model frees its shards, masters and gradient shards at the first
    gc.collect(), not one collection later (Note [ShardedParam holds its coordinator weakly])."""
    for rank, got in enumerate(
        run_distributed(_stage3_one_collection, world_size=2, timeout_s=120)
    ):
        assert got["alive"] == [0, 0], f"rank {rank}: ShardedParams alive after gc: {got['alive']}"
        for left in got["left"]:
            # Shards + gradient shards are ~6.4 MB per rank here; allow 1 MB of allocator noise.
            assert left is None or left < 1_000_000, (
                f"rank {rank}: {left / 1e6:.1f} MB still allocated after del + gc.collect()"
            )
