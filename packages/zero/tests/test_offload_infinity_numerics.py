"""ZeRO-Infinity at stage 3 (`offload_optimizer: nvme`, with and without `offload_param: nvme`):
the fp32 masters, Adam states and gradient shards live in swap files, and TinyGPT still trains to
the losses of single-process PyTorch (fp32, ≤ 1e-5 relative) on 2 ranks: plain, with global-norm
clipping (the norm kept as the gradients are written), and with 2 accumulation micro-steps
(read-add-write of the gradient files).

After every step no master and no gradient shard is held in memory: the optimizer's parameters
are meta handles, every `ShardedParam.master` and every gradient shard of the reducer is None,
and the gradient and partition files hold exactly 4 and 12 bytes per shard element.
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
from minispeed.zero.memory import measure, measure_offload, predict_offload

offload = pytest.importorskip("minispeed.offload")

STEPS = 10
RELEASE = {
    "stage": 3,
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 3000,
    "stage3_max_live_parameters": 4500,
    "sub_group_size": 2500,
}
CASES = {  # name: (param device, accumulation steps, clip)
    "param_nvme": ("nvme", 1, 0.0),
    "param_nvme+clip": ("nvme", 1, 0.05),
    "param_none+accum2": ("none", 2, 0.0),
}


def _config(nvme_path: str, param: str, accum: int, clip: float) -> zero.ZeroConfig:
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    section = {
        **RELEASE,
        "offload_optimizer": {**nvme, "buffer_count": 3, "pipeline_read": True},
    }
    if param == "nvme":
        section["offload_param"] = {**nvme, "buffer_count": 2, "buffer_size": 2000}
    return zero.ZeroConfig.from_section(
        section, gradient_accumulation_steps=accum, max_grad_norm=clip
    )


def _roundup(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096  # each swap file is padded to 4 KiB (O_DIRECT)


def _train(rank: int, world_size: int, nvme_path: str) -> dict:
    out = {}
    for case, (param, accum, clip) in CASES.items():
        model = make_model()
        cfg = _config(nvme_path, param, accum, clip)
        opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
        inner = opt.optimizer
        sps = opt.strategy.sharded_params()
        grad_shard = opt.strategy.stage.reducer.grad_shard
        losses, held = [], 0
        for batch in make_batches(STEPS * accum, GLOBAL_BATCH):
            loss = model(*rank_slice(batch, rank, world_size))
            losses.append(global_loss(loss, world_size))
            opt.backward(loss)
            # between backward and the step: the gradient shards are already in their files
            held += sum(grad_shard(sp) is not None or sp.master is not None for sp in sps)
            opt.step()
            held += sum(grad_shard(sp) is not None or sp.master is not None for sp in sps)
        grads = inner.grads
        elements = sum(sp.shard_numel for sp in sps)
        out[case] = dict(
            losses=losses,
            optimizer=type(inner).__name__,
            held=held,
            handles_on_meta=all(
                p.device.type == "meta" for g in inner.param_groups for p in g["params"]
            ),
            grad_file_bytes=sum(os.path.getsize(st.path) for st in grads.files.values()),
            partition_file_bytes=sum(os.path.getsize(p.swap.path) for p in inner.partitions),
            expected_grad_bytes=sum(_roundup(4 * sp.shard_numel) for sp in sps),
            partition_elements=sum(p.numel for p in inner.partitions),
            expected_partition_bytes=sum(_roundup(12 * p.numel) for p in inner.partitions),
            elements=elements,
            grad_io=(grads.bytes_read, grads.bytes_written),
            resident=inner.resident_state_bytes(),
            pools=inner.swapper.pool.nbytes + grads.swapper.pool.nbytes + grads.read_pool.nbytes,
            measured=measure_offload(opt),
            live=measure(opt, model),
            predicted=predict_offload(opt),
        )
        opt.close()
    return out


def test_infinity_stage3_losses_match_pytorch(tmp_path) -> None:
    results = run_distributed(_train, world_size=2, args=(str(tmp_path),), timeout_s=300)
    for case, (_, accum, clip) in CASES.items():
        ref = reference_losses(STEPS, accum=accum, clip=clip)
        for rank, res in enumerate(results):
            got = res[case]
            for step, (a, b) in enumerate(zip(got["losses"], ref, strict=True)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{case} rank {rank} step {step}: {a} vs {b}"
            assert got["optimizer"] == "SwappedMastersOptimizer"
            assert got["handles_on_meta"]
            assert got["held"] == 0, f"{case}: a master or gradient shard stayed in memory"
            # 4 B per shard element of gradients and 12 B of master + states, in files
            assert got["grad_file_bytes"] == got["expected_grad_bytes"]
            assert got["partition_elements"] == got["elements"]
            assert got["partition_file_bytes"] == got["expected_partition_bytes"]
            assert got["resident"] == got["pools"]  # the pools, nothing per parameter
            # the formula of zero.memory says the same, file by file and pool by pool
            assert got["measured"] == got["predicted"]
            # the live tensors: no master, no optimizer state, no gradient in memory
            live = got["live"]
            assert (live.master, live.optimizer_states, live.grads) == (0, 0, 0), live
            assert got["predicted"].grad_files == got["expected_grad_bytes"]
            read, written = got["grad_io"]
            assert read > 0 and written > 0
    # clipping changed the run (the threshold is below the gradients' norm)
    assert results[0]["param_nvme+clip"]["losses"] != results[0]["param_nvme"]["losses"]
