"""Who shares the checkpoint directory (Note [who shares the checkpoint directory]): ranks that
each see their own directory are refused on every rank before any file is written, unless
`node_local=True`, with which each directory gets its ranks' shards plus its own common files,
and a resume from them continues on the uninterrupted loss curve."""

from __future__ import annotations

from pathlib import Path

import pytest
from ckpt_testlib import build, reference_losses, train

from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import CheckpointError, load_checkpoint, save_checkpoint


def _body(rank: int, world_size: int, base: str, stage: int):
    mine = Path(base) / f"node{rank}"  # each rank a directory the other never sees
    model, opt = build(stage)
    train(model, opt, rank, world_size, range(0, 3))
    with pytest.raises(CheckpointError) as refused:
        save_checkpoint(opt, model, mine / "shared")
    written = [p.name for p in (mine / "shared").rglob("*") if p.is_file()]
    save_checkpoint(opt, model, mine / "local", node_local=True)
    files = sorted(str(p.relative_to(mine / "local")) for p in (mine / "local").rglob("*"))
    model2, opt2 = build(stage, seed=7)  # other initial weights: everything comes from the files
    load_checkpoint(opt2, model2, mine / "local")
    resumed = train(model2, opt2, rank, world_size, range(3, 6))
    return str(refused.value), written, files, resumed


@pytest.mark.parametrize("stage", [0, 2])
def test_unshared_directories_are_refused_or_kept_node_local(tmp_path, stage: int) -> None:
    results = run_distributed(_body, world_size=2, args=(str(tmp_path), stage), timeout_s=120)
    want = reference_losses()[3:6]
    for rank, (refused, written, files, resumed) in enumerate(results):
        assert "is not shared by all ranks" in refused and "node_local=True" in refused, refused
        assert "rank 0 sees the probes of ranks [0]" in refused
        assert written == []  # refused before anything was written
        assert f"global_step3/weights.rank{rank:05d}-of-00002.pt" in files
        assert f"global_step3/weights.rank{1 - rank:05d}-of-00002.pt" not in files
        assert {"latest", "global_step3/common.pt", "global_step3/metadata.json"} <= set(files)
        assert resumed == pytest.approx(want, rel=1e-5)
