"""A damaged checkpoint file is named with its tag, its damage and the tag to load instead; and
each rank opens only the shard files holding its fragments (Note [damaged files])."""

from __future__ import annotations

import os

import pytest
import torch
from ckpt_testlib import build, train

from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import (
    CheckpointError,
    consolidate,
    load_checkpoint,
    save_checkpoint,
)

SHARD = "weights.rank00001-of-00002.pt"


def _save_two_tags_body(rank: int, world_size: int, path: str) -> None:
    model, opt = build(stage=2)
    for step in range(2):
        train(model, opt, rank, world_size, range(step, step + 1))
        save_checkpoint(opt, model, path)  # global_step1, then global_step2


def _load_body(rank: int, world_size: int, path: str) -> str:
    model, opt = build(stage=2, seed=4)
    try:
        load_checkpoint(opt, model, path)
    except CheckpointError as e:
        return str(e)
    return ""


def _opens_body(rank: int, world_size: int, path: str) -> list[str]:
    model, opt = build(stage=2, seed=4)
    opened: list[str] = []
    real_load = torch.load

    def counting_load(f, *args, **kwargs):
        opened.append(os.path.basename(os.fspath(f)))
        return real_load(f, *args, **kwargs)

    torch.load = counting_load
    try:
        load_checkpoint(opt, model, path, tag="global_step1")
    finally:
        torch.load = real_load  # the worker process serves later tests too
    return sorted(opened)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("damage")
    run_distributed(_save_two_tags_body, world_size=2, args=(str(path),), timeout_s=120)
    return path


def test_each_rank_opens_only_the_shards_holding_its_fragments(saved):
    opened = run_distributed(_opens_body, world_size=2, args=(str(saved),), timeout_s=120)
    for rank, files in enumerate(opened):
        # Same world size and stage: rank r's fragments are exactly shard r's pieces.
        assert files == sorted(
            [
                "common.pt",
                f"weights.rank{rank:05d}-of-00002.pt",
                f"optim.rank{rank:05d}-of-00002.pt",
            ]
        )


def test_a_truncated_shard_is_named_with_its_tag_damage_and_the_complete_tag(saved):
    damaged = saved / "global_step2" / SHARD
    size = damaged.stat().st_size
    with open(damaged, "r+b") as f:
        f.truncate(size // 2)
    messages = run_distributed(_load_body, world_size=2, args=(str(saved),), timeout_s=120)
    for message in messages:  # every rank raises, with the same message
        assert str(damaged) in message
        assert "tag 'global_step2'" in message
        assert f"truncated: {size // 2} bytes on disk, {size} bytes when saved" in message
        assert "Tag 'global_step1'" in message and "is complete" in message
    with pytest.raises(CheckpointError, match=r"weights\.rank00001-of-00002\.pt.*truncated"):
        consolidate(saved, saved / "out.pt")
    # The complete tag named there does load.
    assert run_distributed(
        _load_tag_body, world_size=2, args=(str(saved), "global_step1"), timeout_s=120
    ) == [1, 1]


def _load_tag_body(rank: int, world_size: int, path: str, tag: str) -> int:
    model, opt = build(stage=2, seed=4)
    load_checkpoint(opt, model, path, tag=tag)
    return opt.global_step


def test_a_shard_overwritten_with_garbage_of_its_size_is_named_as_damaged(saved, tmp_path, capsys):
    """The size check cannot see it; the one loader of checkpoint files (`load_shard`) names it
    in `load_checkpoint` (on every rank), `consolidate` and its command alike (issue 32 §7)."""
    import shutil

    from minispeed.zero.__main__ import main

    copy = tmp_path / "ckpt"
    shutil.copytree(saved / "global_step1", copy / "global_step1")
    (copy / "latest").write_text("global_step1")
    damaged = copy / "global_step1" / SHARD
    damaged.write_bytes(os.urandom(damaged.stat().st_size))
    messages = run_distributed(_load_body, world_size=2, args=(str(copy),), timeout_s=120)
    for message in messages:  # every rank raises, naming the file
        assert f"checkpoint file {damaged} of tag 'global_step1' is damaged" in message, message
    with pytest.raises(CheckpointError, match=rf"{SHARD} of tag 'global_step1' is damaged"):
        consolidate(copy, tmp_path / "out.pt")
    assert main(["consolidate", str(copy), str(tmp_path / "cli.pt")]) == 1
    out = capsys.readouterr().out.replace("\n", "")
    assert SHARD in out and "is damaged" in out and "Traceback" not in out
    common = copy / "global_step1" / "common.pt"  # unpickled, not mapped: another error type
    common.write_bytes(os.urandom(common.stat().st_size))
    with pytest.raises(CheckpointError, match=r"common\.pt of tag 'global_step1' is damaged"):
        consolidate(copy, tmp_path / "out.pt")


def test_a_garbled_metadata_json_is_named_as_damaged(saved, tmp_path):
    """The seal itself cut short or overwritten: named as a damaged file of its tag, with the tag
    to load instead (it was a bare `JSONDecodeError` naming no file)."""
    import shutil

    copy = tmp_path / "ckpt"
    for tag in ("global_step1", "global_step2"):
        shutil.copytree(saved / tag, copy / tag)
    meta = copy / "global_step2" / "metadata.json"
    meta.write_text(meta.read_text()[:40])  # a copy cut short
    with pytest.raises(CheckpointError) as e:
        consolidate(copy / "global_step2", tmp_path / "out.pt")
    message = str(e.value)
    assert f"checkpoint file {meta} of tag 'global_step2' is damaged" in message, message
    assert "Tag 'global_step1'" in message and "is complete" in message, message
