"""A rank killed while writing its shard leaves the previous checkpoint loadable and `latest` on it;
the interrupted tag is refused by name, by the loader and by the consolidation."""

from __future__ import annotations

import os

import pytest
import torch
from ckpt_testlib import build, model_state, train

from minispeed.core.testing import DistributedTestError, run_distributed
from minispeed.zero.checkpoints import (
    CheckpointError,
    consolidate,
    load_checkpoint,
    save_checkpoint,
)
from minispeed.zero.checkpoints.layout import CRASH_RANK_ENV


def _save_then_die_body(rank: int, world_size: int, path: str, expected_file: str) -> None:
    model, opt = build(stage=1)
    train(model, opt, rank, world_size, range(0, 1))
    save_checkpoint(opt, model, path, tag="good")
    if rank == 0:
        torch.save(model_state(model), expected_file)
    train(model, opt, rank, world_size, range(1, 2))
    if rank == 1:
        os.environ[CRASH_RANK_ENV] = "1"  # only in the process that is about to die
    save_checkpoint(opt, model, path, tag="torn")  # rank 1 exits halfway through its shard


def _load_body(rank: int, world_size: int, path: str, tag: str | None):
    model, opt = build(stage=1, seed=5)
    try:
        load_checkpoint(opt, model, path, tag=tag)
    except CheckpointError as e:
        return str(e)
    return model_state(model)


@pytest.fixture(scope="module")
def torn(tmp_path_factory):
    path = tmp_path_factory.mktemp("atomic")
    expected = path / "expected.pt"
    with pytest.raises(DistributedTestError, match=r"rank 1"):
        run_distributed(
            _save_then_die_body,
            world_size=2,
            args=(str(path / "ckpt"), str(expected)),
            timeout_s=120,
        )
    return path / "ckpt", torch.load(expected)


def test_latest_still_names_the_previous_tag_and_it_loads_exactly(torn):
    ckpt, expected = torn
    assert (ckpt / "latest").read_text().strip() == "good"
    assert not (ckpt / "torn" / "metadata.json").exists()
    assert (ckpt / "torn").is_dir()  # the crash really happened mid-save
    for state in run_distributed(_load_body, world_size=2, args=(str(ckpt), None), timeout_s=120):
        assert state.keys() == expected.keys()
        for k in expected:
            torch.testing.assert_close(state[k], expected[k], rtol=0, atol=0, msg=k)


def test_the_torn_tag_is_refused_naming_the_missing_shards(torn):
    ckpt, _ = torn
    with pytest.raises(CheckpointError, match=r"incomplete.*weights\.rank00001-of-00002\.pt"):
        consolidate(ckpt, ckpt.parent / "out.pt", tag="torn")
    messages = run_distributed(_load_body, world_size=2, args=(str(ckpt), "torn"), timeout_s=120)
    for msg in messages:
        assert "incomplete" in msg and "optim.rank00001-of-00002.pt" in msg
        assert "'latest' points to 'good'" in msg
