"""ZeRO-Offload, stages 1 and 2: optimizer states on the CPU or in NVMe files train TinyGPT to the
same losses as single-process PyTorch (fp32, 20 steps, ≤ 1e-5 relative).

One 2-rank run per stage covers, in sequence, the ds_config sections a user writes:
`offload_optimizer: {device: cpu}` and `{device: nvme, ...}` with several swapped partitions
(`sub_group_size` small), two buffers and the read/write pipeline on, plus an `aio` section.
Needs the `[offload]` extra (minispeed-offload); skipped without it.
"""

from __future__ import annotations

import pytest
import torch
from stage012_testlib import max_relative_error, reference_run, zero_run

import minispeed.zero as zero
import minispeed.zero.offload_bridge as bridge
from minispeed.core.testing import run_distributed

offload = pytest.importorskip("minispeed.offload")


def ds_configs(stage: int, nvme_path: str) -> list[dict]:
    """The two offload configurations of one stage, as DeepSpeed config dicts."""
    cpu = {"zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    nvme = {
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 4000,
            "sub_group_size": 3000,  # several partitions: the swap pipeline really runs
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme_path,
                "buffer_count": 2,
                "pipeline_read": True,
                "pipeline_write": True,
            },
        },
        "aio": {"block_size": 65536, "queue_depth": 2, "thread_count": 1},
    }
    return [cpu, nvme, cpu]  # the last one with host copies (see _train)


def _train(rank: int, world_size: int, stage: int, nvme_path: str):
    out = []
    try:
        return _runs(rank, world_size, stage, nvme_path, out)
    finally:
        bridge.ALWAYS_COPY = False  # the worker process serves later tests too


def _runs(rank: int, world_size: int, stage: int, nvme_path: str, out: list):
    for k, ds in enumerate(ds_configs(stage, nvme_path)):
        # The third run keeps separate host masters and gradient copies, as on a GPU: gradients
        # copied down after the reduction, masters copied up before the all-gather.
        bridge.ALWAYS_COPY = k == 2
        config = zero.ZeroConfig.from_section(ds["zero_optimization"], aio=ds.get("aio"))
        losses, _, opt = zero_run(rank, world_size, "adamw", config)
        inner = opt.optimizer
        swapped = isinstance(inner, offload.SwappedOptimizer)
        moved = (inner.swapper.bytes_read, inner.swapper.bytes_written) if swapped else (0, 0)
        out.append((losses, type(inner).__name__, moved, opt.global_step))
        if swapped:
            inner.close()
        copies = not opt.strategy.aliased
        assert copies == (k == 2)
        if copies:  # the CPU Adam stepped host tensors distinct from the strategy's masters
            sizes = [m.numel() for m in opt.strategy.master_params()[0]]
            i = sizes.index(max(sizes))  # a fragment this rank holds (some are empty)
            host = opt.strategy.master_params()[0][i]
            device = opt.strategy.strategy.master_params()[0][i]
            assert host.data_ptr() != device.data_ptr() and torch.equal(host, device)
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_offloaded_optimizer_losses_match_pytorch(stage: int, tmp_path) -> None:
    per_rank = run_distributed(_train, world_size=2, args=(stage, str(tmp_path)), timeout_s=180)
    ref_losses, _, _ = reference_run("adamw")
    for (losses, kind, _, steps), expected in zip(per_rank[0], ["CPUAdam", "SwappedOptimizer"]):
        assert kind == expected  # the offload path really ran, not the user's torch AdamW
        assert steps == len(ref_losses)
        assert max_relative_error(losses, ref_losses) <= 1e-5, (kind, losses, ref_losses)
    # nvme: the states went through the files on every step (19 reads: the first step starts
    # from zeros without reading), on both ranks.
    for rank_results in per_rank:
        read, written = rank_results[1][2]
        assert read > 0 and written > read
    assert not list(tmp_path.iterdir()) or all(not any(d.iterdir()) for d in tmp_path.iterdir()), (
        "swap files left behind after close()"
    )
    torch.testing.assert_close(per_rank[0][0][0], per_rank[1][0][0])
