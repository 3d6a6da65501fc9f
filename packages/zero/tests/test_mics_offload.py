"""MiCS composes with offload: parameter shards and optimizer states in host memory, partitioned
over the shard group (S = 2 of 4 gloo ranks), train TinyGPT like single-process PyTorch, and
ZeRO-Infinity's optimizer files (NVMe) too. Needs the `[offload]` extra; skipped without it."""

from __future__ import annotations

import pytest
import torch
from stage3_testlib import GLOBAL_BATCH, LR, global_loss, reference_losses
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

offload = pytest.importorskip("minispeed.offload")

STEPS = 4


def _body(rank: int, world_size: int, nvme_path: str) -> dict:
    out = {}
    for name, section in {
        "param cpu + optimizer cpu": {"offload_param": {"device": "cpu"},
                                      "offload_optimizer": {"device": "cpu"}},
        "optimizer nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}},
    }.items():  # fmt: skip
        model = make_model()
        ds = {"zero_optimization": {"stage": 3, "mics_shard_size": 2, **section}}
        cfg = zero.ZeroConfig.from_section(ds["zero_optimization"])
        opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
        losses = []
        for batch in make_batches(STEPS, GLOBAL_BATCH):
            loss = model(*rank_slice(batch, rank, world_size))
            losses.append(global_loss(loss, world_size))
            opt.backward(loss)
            opt.step()
        shards = {sp.world_size for sp in opt.strategy.sharded_params()}
        opt.close()
        out[name] = (losses, shards)
    return out


def test_mics_with_offload_trains_like_pytorch(tmp_path):
    results = run_distributed(_body, world_size=4, timeout_s=240, args=(str(tmp_path),))
    reference = reference_losses(STEPS)
    for r in results:
        for name, (losses, shards) in r.items():
            assert shards == {2}, name
            torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0, msg=name)
