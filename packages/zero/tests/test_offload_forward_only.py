"""Stage 3 without an optimizer with `offload_param` (ZeRO-Inference's usual set-up), 2 gloo ranks.

- `cpu` (bf16): each rank's forward equals single-process PyTorch on its slice, bit for bit,
  and no shard has a master;
- `nvme`, model built under `zero.Init(config)` (each shard written to its file as it is made,
  so the model never exists whole): the forward equals PyTorch, every released shard is back in
  its file after the pass (0 elements in memory) and was read at each fetch, and no parameter
  got an fp32 master (`zero.shard` adopting Init's files used to give every one a master
  copy, 4 bytes per element of host memory a forward never reads).

Needs the `[offload]` extra; skipped without it.
"""

from __future__ import annotations

import pytest
import torch
from stage3_testlib import GLOBAL_BATCH
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

offload = pytest.importorskip("minispeed.offload")

RELEASE = {"stage": 3, "stage3_param_persistence_threshold": 30}


def _forward(rank: int, world_size: int, nvme_path: str) -> dict:
    batch = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, world_size)
    out = {}
    cfg = zero.ZeroConfig.from_section({**RELEASE, "offload_param": {"device": "cpu"}})
    model = make_model().to(torch.bfloat16)
    shards = zero.shard(model, None, cfg)
    with torch.no_grad():
        out["cpu"] = dict(
            losses=[model(*batch) for _ in range(2)],
            masters=sum(sp.master is not None for sp in shards.sharded_params()),
        )
    shards.close()

    nvme = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2, "buffer_size": 4000}
    cfg = zero.ZeroConfig.from_section({**RELEASE, "offload_param": nvme})
    with zero.Init(config=cfg):
        model = make_model()
    shards = zero.shard(model, None, cfg)
    home = shards.strategy.param_home
    with torch.no_grad():
        losses = [model(*batch) for _ in range(2)]
    out["nvme"] = dict(
        losses=losses,
        masters=sum(sp.master is not None for sp in shards.sharded_params()),
        offloaded=len(shards.strategy.offloaded),
        resident=sum(sp.shard.numel() for sp in shards.strategy.offloaded),
        read=home.bytes_read,
        measured=zero.measure(shards, model),
    )
    shards.close()
    return out


def test_forward_only_with_offloaded_params_matches_pytorch(tmp_path) -> None:
    results = run_distributed(_forward, world_size=2, args=(str(tmp_path),), timeout_s=180)
    for rank, res in enumerate(results):
        batch = rank_slice(make_batches(1, GLOBAL_BATCH)[0], rank, 2)
        for case, model in (("cpu", make_model().to(torch.bfloat16)), ("nvme", make_model())):
            want = model(*batch)
            for got in res[case]["losses"]:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert res[case]["masters"] == 0, case
        nvme = res["nvme"]
        assert nvme["offloaded"] > 0 and nvme["resident"] == 0  # every shard in its file
        assert nvme["read"] > 0
        assert nvme["measured"].master == nvme["measured"].grads == 0
