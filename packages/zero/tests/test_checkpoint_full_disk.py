"""A checkpoint file whose write fails half-way (the kernel refuses the bytes past a file-size
limit: EFBIG, where a full disk gives ENOSPC) leaves the previous file as it was and no temporary
file beside it, for the shard writes of `save_checkpoint` and for `consolidate`'s output (Note
[atomic checkpoint]); a shard write says why it failed, naming the file."""

from __future__ import annotations

import contextlib
import resource
import signal

import pytest
import torch
from ckpt_testlib import build, train

from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import consolidate, save_checkpoint
from minispeed.zero.checkpoints.layout import atomic_save


@contextlib.contextmanager
def _disk_full_after(nbytes: int):
    """Writes past `nbytes` of a file fail with EFBIG, as a full disk fails them with ENOSPC."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an error, not a killed process
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_shard_write_cut_short_keeps_the_old_file_and_leaves_nothing(tmp_path) -> None:
    path = tmp_path / "weights.rank00000-of-00001.pt"
    old = {"values": torch.arange(10.0)}
    atomic_save(old, path)
    with pytest.raises(OSError) as e, _disk_full_after(4096):
        atomic_save({"values": torch.ones(64 * 1024)}, path)  # 256 KiB: cut at 4 KiB
    # the file system's words and the file, not torch's "unexpected pos N vs M"
    assert "File too large" in str(e.value) and path.name in str(e.value), str(e.value)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    torch.testing.assert_close(torch.load(path)["values"], old["values"])


def _save_body(rank: int, world_size: int, path: str) -> None:
    model, opt = build(stage=2)
    train(model, opt, rank, world_size, range(0, 1))
    save_checkpoint(opt, model, path, tag="t")


def test_a_consolidation_cut_short_keeps_the_old_output_and_leaves_nothing(tmp_path) -> None:
    run_distributed(_save_body, world_size=1, args=(str(tmp_path / "ckpt"),), timeout_s=120)
    out = tmp_path / "out" / "model.pt"
    out.parent.mkdir()
    out.write_bytes(b"the previous consolidation")
    with pytest.raises((OSError, RuntimeError)), _disk_full_after(4096):
        consolidate(tmp_path / "ckpt", out)
    assert [p.name for p in out.parent.iterdir()] == ["model.pt"]
    assert out.read_bytes() == b"the previous consolidation"
    consolidate(tmp_path / "ckpt", out)  # with room, the same call writes it whole
    assert "wte.weight" in torch.load(out)
