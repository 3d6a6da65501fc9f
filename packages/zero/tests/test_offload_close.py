"""`ZeroOptimizer.close()` deletes the NVMe swap files at every stage, at once (issue 24 §4).

Stage 3 already removed them (its strategy closes the swappers); at stages 1-2 the optimizer's
swap directory stayed on disk until the optimizer object was garbage-collected. The test keeps
a reference to the optimizer, so only `close()` itself can have removed them.
"""

from __future__ import annotations

import pytest
import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

pytest.importorskip("minispeed.offload")


def _close(rank: int, world_size: int, stage: int, root: str) -> tuple[int, int]:
    nvme = {"device": "nvme", "nvme_path": root, "buffer_count": 2}
    section = {"stage": stage, "offload_optimizer": nvme}
    config = zero.ZeroConfig.from_section(section)
    model = make_model()
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
    opt.backward(model(*rank_slice(make_batches(1, 8)[0], rank, world_size)))
    opt.step()
    swap_dir = opt.optimizer.swapper.dir.path
    before = len(list(swap_dir.iterdir()))
    opt.close()
    after = len(list(swap_dir.iterdir())) if swap_dir.exists() else 0
    assert opt.optimizer is not None  # still referenced: nothing was garbage-collected
    return before, after


@pytest.mark.parametrize("stage", [1, 2])
def test_close_deletes_the_swap_files(stage: int, tmp_path) -> None:
    for before, after in run_distributed(_close, args=(stage, str(tmp_path)), timeout_s=90):
        assert before > 1  # the lock file and the swap files existed
        assert after == 0
    assert not any(tmp_path.iterdir())
