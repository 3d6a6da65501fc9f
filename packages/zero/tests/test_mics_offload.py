"""MiCS composes with offload: parameter shards and optimizer states partitioned over the shard
group (S = 2 of 4 gloo ranks) train TinyGPT like single-process PyTorch in host memory, with the
optimizer's files on NVMe, and as ZeRO-Infinity whole (parameters and optimizer on NVMe, the
model built by ``zero.Init(config)`` straight into its swap files over the shard groups).

A swap file lost on one rank fails every rank: with rank 1's optimizer partition deleted, the
step's I/O agreement runs over all four ranks (not over shard group [0 1] only, which left
ranks 2 and 3 stepping on, their replicas gone) and each raises `zero.OffloadIOError` naming
rank 1; so do ``GatheredParameters`` and ``close()`` once rank 1 lost a parameter shard's file.
Needs the `[offload]` extra; skipped without it.
"""

from __future__ import annotations

import os

import pytest
import torch
from stage3_testlib import GLOBAL_BATCH, LR, global_loss, reference_losses
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3 import REGISTRY

offload = pytest.importorskip("minispeed.offload")

STEPS = 3


def _sections(nvme_path: str) -> dict[str, dict]:
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    return {
        "param cpu + optimizer cpu": {"offload_param": {"device": "cpu"},
                                      "offload_optimizer": {"device": "cpu"}},
        "optimizer nvme": {"offload_optimizer": nvme},
        "Init, param nvme + optimizer nvme": {
            "offload_param": {**nvme, "buffer_count": 2, "buffer_size": 2000},
            "offload_optimizer": nvme},
    }  # fmt: skip


def _body(rank: int, world_size: int, nvme_path: str) -> dict:
    out = {}
    for name, section in _sections(nvme_path).items():
        ds = {"stage": 3, "mics_shard_size": 2, **section}
        cfg = zero.ZeroConfig.from_section({**ds, "stage3_param_persistence_threshold": 30})
        if name.startswith("Init"):  # built into the swap files, shard group by shard group
            with zero.Init(config=cfg) as init:
                model = make_model()
            files = {sp.world_size for sp in init.sharded if sp.home.io_failures is not None}
        else:
            model = make_model()
        opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
        batches = make_batches(STEPS + 1, GLOBAL_BATCH)
        losses = []
        for batch in batches[:STEPS]:
            loss = model(*rank_slice(batch, rank, world_size))
            losses.append(global_loss(loss, world_size))
            opt.backward(loss)
            opt.step()
        out[name] = (losses, {sp.world_size for sp in opt.strategy.sharded_params()})
        if name.startswith("Init"):
            out["in files from Init"] = files
            if rank == 1:  # lost under the running job: the next step cannot read it
                os.remove(opt.optimizer.partitions[0].swap.path)
            try:
                opt.backward(model(*rank_slice(batches[STEPS], rank, world_size)))
                opt.step()
            except zero.OffloadIOError as exc:
                out["step error"] = str(exc)
            wte = REGISTRY[model.wte.weight]
            if rank == 1:  # a parameter shard's file now: read on entering GatheredParameters
                os.remove(opt.strategy.param_home.files[id(wte)].path)
            try:
                with zero.GatheredParameters(model.wte.weight):
                    pass
            except zero.OffloadIOError as exc:
                out["gather error"] = str(exc)
            try:
                opt.close()  # gathers the model back: the shard is still missing
            except zero.OffloadIOError as exc:
                out["close error"] = str(exc)
        else:
            opt.close()
    return out


def test_mics_with_offload_trains_like_pytorch_and_a_lost_file_fails_every_rank(tmp_path):
    results = run_distributed(_body, world_size=4, timeout_s=240, args=(str(tmp_path),))
    reference = reference_losses(STEPS)
    for r in results:
        for name in _sections(""):
            losses, shards = r[name]
            assert shards == {2}, name
            torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0, msg=name)
        assert r["in files from Init"] == {2}
        for error, where in [
            ("step error", "the end of the optimizer step"),
            ("gather error", "GatheredParameters, reading shards"),
            ("close error", "close(), gathering the model back"),
        ]:
            assert "failed on rank 1 of 4" in r.get(error, ""), (error, r)
            assert where in r[error], r[error]
