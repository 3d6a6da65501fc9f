"""A set-up check that fails on ONE rank is the same clear error on EVERY rank (issue 24 §2.4).

`zero.shard`'s offload set-up depends on each rank's machine: the `nvme_path` directory, its
free space, the first writes of ZeRO-Infinity's masters. Each case breaks rank 1 only, then
every rank that got through `zero.shard` runs a training step. Every rank must raise, within
seconds, the same error naming rank 1 and the fix: `OffloadSetupError` for the checks
(Note [a set-up check fails on every rank]), `OffloadIOError` for a failed first write.

Before: rank 1 raised alone (`FileNotFoundError`; a full disk under ZeRO-Infinity even a raw
`OSError` from the cleanup of the pending writes) and rank 0 went on into its next collective,
which then timed out (a hang here, caught by the harness's short timeout). Needs `[offload]`.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from zero_testlib import make_batches, make_model, rank_slice

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

offload = pytest.importorskip("minispeed.offload")

TIMEOUT_S = 60  # a hang fails fast: each body takes a few seconds


def _config(stage: int, path: str) -> zero.ZeroConfig:
    nvme = {"device": "nvme", "nvme_path": path, "buffer_count": 2}
    section: dict = {"stage": stage, "sub_group_size": 3000, "offload_optimizer": nvme}
    if stage == 3:  # ZeRO-Infinity
        section["offload_param"] = {**nvme, "buffer_size": 2000}
    return zero.ZeroConfig.from_section(section)


def _shard_and_step(rank: int, world_size: int, config: zero.ZeroConfig) -> str:
    """zero.shard, then one step; the error this rank got, as 'Type: message' ('' if none)."""
    model = make_model()
    try:
        opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config)
        batch = rank_slice(make_batches(1, 8)[0], rank, world_size)
        opt.backward(model(*batch))
        opt.step()
        opt.close()
    except (RuntimeError, OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _bad_path_on_rank_1(rank: int, world_size: int, root: str, stage: int, kind: str) -> str:
    path = Path(root) / f"rank{rank}"
    if rank == 0 or kind == "not_a_directory":
        path.mkdir(exist_ok=True)
    if rank == 1 and kind == "not_a_directory":
        path = path / "a-file"
        path.write_text("not a directory")
    return _shard_and_step(rank, world_size, _config(stage, str(path)))


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("kind", ["missing", "not_a_directory"])
def test_bad_nvme_path_on_one_rank_raises_on_every_rank(tmp_path, stage: int, kind: str) -> None:
    errors = run_distributed(
        _bad_path_on_rank_1, args=(str(tmp_path), stage, kind), timeout_s=TIMEOUT_S
    )
    for rank, error in enumerate(errors):
        assert error.startswith("OffloadSetupError: "), f"rank {rank}: {error!r}"
        assert "failed on rank 1 of 2" in error and ".nvme_path=" in error, error
        assert ("does not exist" if kind == "missing" else "is not a directory") in error, error
    assert errors[0] == errors[1]
    assert not list((tmp_path / "rank0").iterdir()), "rank 0 left its swap files behind"


def _little_space_on_rank_1(rank: int, world_size: int, root: str, stage: int) -> str:
    import minispeed.offload.swapper as swapper

    real = swapper.shutil.disk_usage

    def small(path):  # rank 1's disk has 64 KiB free
        usage = real(path)
        return usage._replace(free=64 << 10) if rank == 1 else usage

    swapper.shutil.disk_usage = small  # this worker process only; restored below
    try:
        if stage == 2:
            return _shard_and_step(rank, world_size, _config(2, root))
        param = {"device": "nvme", "nvme_path": root, "buffer_size": 2000}  # parameters only
        section = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": param}
        config = zero.ZeroConfig.from_section(section)
        return _shard_and_step(rank, world_size, config)
    finally:
        swapper.shutil.disk_usage = real


@pytest.mark.parametrize("stage", [2, 3])
def test_too_little_free_space_on_one_rank_raises_on_every_rank(tmp_path, stage: int) -> None:
    """Checked before the first write: the optimizer's swap files (stage 2), the parameter
    shards' (stage 3, `offload_param: nvme` alone, whose files are written at zero.shard)."""
    errors = run_distributed(
        _little_space_on_rank_1, args=(str(tmp_path), stage), timeout_s=TIMEOUT_S
    )
    for rank, error in enumerate(errors):
        assert error.startswith("OffloadSetupError: "), f"rank {rank}: {error!r}"
        assert "failed on rank 1 of 2" in error and "65536 free" in error, error
        assert "point nvme_path at a larger disk" in error, error
        assert ("offload_param" if stage == 3 else "offload_optimizer") in error, error
    assert errors[0] == errors[1]


def _full_disk_in_shard(rank: int, world_size: int, root: str) -> dict:
    """Rank 1's disk fills while zero.shard writes ZeRO-Infinity's first masters: every write of
    an optimizer partition fails when waited on (ENOSPC), as a real full disk does."""
    IORequest = offload.IORequest
    real = IORequest.wait
    victims: list[str] = []

    def full(self):
        nbytes = real(self)
        if rank == 1 and self.write and os.path.basename(self.path).startswith("optimizer-"):
            victims.append(self.path)
            self._error = OSError(errno.ENOSPC, "No space left on device (injected)", self.path)
            raise self._error
        return nbytes

    IORequest.wait = full  # this worker process only; restored below
    try:
        error = _shard_and_step(rank, world_size, _config(3, root))
    finally:
        IORequest.wait = real
    return dict(error=error, victim=victims[0] if victims else "")


def test_full_disk_during_shard_raises_offload_io_error_on_every_rank(tmp_path) -> None:
    results = run_distributed(_full_disk_in_shard, args=(str(tmp_path),), timeout_s=TIMEOUT_S)
    victim = results[1]["victim"]
    assert victim
    for rank, res in enumerate(results):
        assert res["error"].startswith("OffloadIOError: "), f"rank {rank}: {res['error']!r}"
        assert "failed on rank 1 of 2" in res["error"] and victim in res["error"], res["error"]
        assert "zero.shard, writing the first masters" in res["error"], res["error"]
    assert results[0]["error"] == results[1]["error"]
    assert not any(tmp_path.iterdir()), "swap files left behind"


def _bad_path_in_init(rank: int, world_size: int, root: str) -> str:
    path = Path(root) / f"rank{rank}"
    if rank == 0:
        path.mkdir(exist_ok=True)
    try:
        with zero.Init(config=_config(3, str(path))):
            make_model()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def test_bad_nvme_path_on_one_rank_in_init_raises_on_every_rank(tmp_path) -> None:
    """`zero.Init(config)` opens the parameters' swap directory at the first parameter, between
    the broadcasts that partition the model: rank 1's missing path must not leave rank 0
    waiting in the next broadcast (before: rank 1 raised out of the model's constructor)."""
    errors = run_distributed(_bad_path_in_init, args=(str(tmp_path),), timeout_s=TIMEOUT_S)
    for rank, error in enumerate(errors):
        assert error.startswith("OffloadIOError: "), f"rank {rank}: {error!r}"
        assert "failed on rank 1 of 2" in error and "end of zero.Init" in error, error
        assert "offload_param.nvme_path=" in error and "does not exist" in error, error
    assert errors[0] == errors[1]
