"""Checkpoints with offloaded optimizer states (and, stage 3, offloaded parameters): resuming
repeats the uninterrupted run, and the saved states move between offload modes.

Saved under `offload_optimizer: nvme` (states in swap files, read into the checkpoint), then
loaded into fresh objects (other initial weights) under nvme (bit-equal continuation), under
`cpu` (same CPU Adam kernel: bit-equal) and without offload (torch's AdamW: ≤ 1e-5 relative).
At stage 3 the nvme optimizer keeps its masters in the files too (stage3/infinity.py): the
checkpoint reads them back, and a load writes them (and the parameter shards) from the file.
Needs the `[offload]` extra.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_testlib import LR, train
from zero_testlib import make_model

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import load_checkpoint, save_checkpoint

pytest.importorskip("minispeed.offload")


def _build(stage: int, seed: int, opt_device: str, nvme: str, param_device: str = "none"):
    section = {"stage": stage, "reduce_bucket_size": 2000, "sub_group_size": 3000}
    if opt_device != "none":
        section["offload_optimizer"] = {"device": opt_device, "nvme_path": nvme}
    if param_device != "none":
        section["offload_param"] = {"device": param_device, "nvme_path": nvme, "buffer_size": 4096}
    if stage == 3:
        section["stage3_param_persistence_threshold"] = 0
    model = make_model(seed)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    config = zero.ZeroConfig.from_section(section)
    return model, zero.shard(model, inner, config=config)


def _body(rank: int, world_size: int, stage: int, root: str):
    param = "nvme" if stage == 3 else "none"
    model, opt = _build(stage, 0, "nvme", root, param)
    train(model, opt, rank, world_size, range(0, 3))
    save_checkpoint(opt, model, f"{root}/ckpt")
    uninterrupted = train(model, opt, rank, world_size, range(3, 6))
    resumed = {}
    for device in ("nvme", "cpu", "none"):
        model2, opt2 = _build(stage, 123, device, root, param)
        load_checkpoint(opt2, model2, f"{root}/ckpt")
        resumed[device] = (
            type(opt2.optimizer).__name__,
            train(model2, opt2, rank, world_size, range(3, 6)),
        )
    return uninterrupted, resumed


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_with_offloaded_states(stage: int, tmp_path) -> None:
    per_rank = run_distributed(_body, world_size=2, args=(stage, str(tmp_path)), timeout_s=240)
    uninterrupted, resumed = per_rank[0]
    # stage 3: ZeRO-Infinity's optimizer (masters and gradients in files too)
    swapped = "SwappedMastersOptimizer" if stage == 3 else "SwappedOptimizer"
    assert resumed["nvme"] == (swapped, uninterrupted)
    assert resumed["cpu"] == ("CPUAdam", uninterrupted)
    kind, losses = resumed["none"]
    assert kind == "AdamW"
    for a, b in zip(losses, uninterrupted, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
