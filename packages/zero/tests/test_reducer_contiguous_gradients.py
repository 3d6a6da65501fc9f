"""`contiguous_gradients` (DeepSpeed's key): gradients are copied into contiguous bucket buffers
as backward produces them, at every stage; `False` is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed


def test_false_is_refused_naming_the_reason() -> None:
    with pytest.raises(ValueError, match=r"contiguous_gradients: False is not .*one collective"):
        zero.ZeroConfig(contiguous_gradients=False)
    with pytest.raises(ValueError, match=r"^zero_optimization.contiguous_gradients: False is not"):
        zero.ZeroConfig.from_section({"contiguous_gradients": False})
    assert zero.ZeroConfig.from_section({"contiguous_gradients": True}).contiguous_gradients


def _body(rank: int, world_size: int) -> dict[int, tuple[int, int, int]]:
    out = {}
    for stage in (0, 1, 2, 3):
        model = make_model(0)
        config = zero.ZeroConfig(stage=stage, stage3_param_persistence_threshold_numel=0)
        opt = zero.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
        idx, tgt = rank_slice(make_batches(1, 4)[0], rank, world_size)
        opt.backward(model(idx, tgt))
        left = sum(p.grad is not None for p in model.parameters())  # param.grad freed
        grads = [g for gs in opt.strategy.master_grads() for g in gs]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        out[stage] = (left, len(storages), len(grads))
        opt.step()
        opt.close()
    return out


def test_gradients_live_in_one_contiguous_buffer_per_bucket() -> None:
    for per_stage in run_distributed(_body, world_size=2, timeout_s=120):
        for stage, (left, storages, grads) in per_stage.items():
            assert left == 0, f"stage {stage}: param.grad kept"
            # DeepSpeed's default reduce_bucket_size makes one bucket: one buffer holds every
            # gradient, one view per parameter (stages 1-2: of this rank's fragment, possibly
            # empty; Note [one master per fragment] in stage12.py).
            assert storages == 1, f"stage {stage}: {storages} buffers for {grads} gradients"
            assert grads == 30, stage
