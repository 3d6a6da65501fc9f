"""Swapper bad input: bad nvme_path, small buffers, swap files truncated or deleted, crashed runs."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minispeed.core.accelerator import get_accelerator
from minispeed.offload import OffloadOptimizerConfig, SwappedOptimizer, TensorSwapper
from minispeed.offload import swapper as swapper_mod


def _opt(tmp_path: Path, **kw) -> tuple[SwappedOptimizer, list[torch.nn.Parameter]]:
    params = [torch.nn.Parameter(torch.randn(3000)), torch.nn.Parameter(torch.randn(50))]
    cfg = OffloadOptimizerConfig(device="nvme", nvme_path=str(tmp_path), **kw)
    opt = SwappedOptimizer(params, cfg, sub_group_numel=2000, lr=1e-2)
    for p in params:
        p.grad = torch.ones_like(p)
    return opt, params


def test_missing_or_non_directory_nvme_path_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"offload_optimizer\.nvme_path=.*does not exist"):
        _opt(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="nvme_path"):
        _opt(tmp_path / "file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: permissions cannot be tested")
def test_unwritable_nvme_path_names_the_key(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(PermissionError, match="not writable"):
        _opt(ro)


def test_buffer_smaller_than_a_partition_names_buffer_size(tmp_path: Path) -> None:
    sw = TensorSwapper(tmp_path, buffer_count=2, buffer_numel=1024, config_key="offload_param")
    with pytest.raises(ValueError, match=r"raise offload_param\.buffer_size to at least 5000"):
        sw.register("big", 5000)
    sw.close()


def test_pin_memory_failure_names_the_key(tmp_path: Path, monkeypatch) -> None:
    def refuse(t, key):
        raise MemoryError(f"{key}.pin_memory=true: page-locking failed: set {key}.pin_memory false")

    monkeypatch.setattr(swapper_mod, "_mlock", refuse)
    with pytest.raises(MemoryError, match=r"offload_optimizer\.pin_memory"):
        _opt(tmp_path, pin_memory=True)


def test_pinned_buffers_are_page_locked(tmp_path: Path) -> None:
    try:
        opt, _ = _opt(tmp_path, pin_memory=True)  # mlock on a CPU-only machine
    except MemoryError as err:  # RLIMIT_MEMLOCK below the pool's ~100 KiB (unprivileged user)
        pytest.skip(f"page-locking is not allowed here: {err}")
    if get_accelerator().name == "cpu":  # with a GPU, torch's pinned allocator does it instead
        status = Path("/proc/self/status").read_text().splitlines()
        locked = [ln for ln in status if ln.startswith("VmLck")]
        assert locked and int(locked[0].split()[1]) * 1024 >= opt.swapper.pool.nbytes
    opt.close()


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_swap_file_damaged_under_a_running_job_raises(tmp_path: Path, damage: str) -> None:
    opt, _ = _opt(tmp_path)
    opt.step()  # states now on disk
    victim = opt.partitions[0].swap.path
    if damage == "truncate":
        os.truncate(victim, 100)
    else:
        victim.unlink()
    with pytest.raises(OSError, match=str(victim)):
        opt.step()
    opt.close()


def test_swap_files_removed_on_close_and_on_exit(tmp_path: Path) -> None:
    opt, _ = _opt(tmp_path)
    opt.step()
    assert list(tmp_path.glob("minispeed-swap-*/*.swp"))
    opt.close()
    assert not list(tmp_path.iterdir())
    # A process that exits normally without close() leaves nothing behind either.
    code = f"""
        import torch
        from minispeed.offload import OffloadOptimizerConfig, SwappedOptimizer
        p = torch.nn.Parameter(torch.randn(100))
        opt = SwappedOptimizer([p], OffloadOptimizerConfig(device="nvme", nvme_path={str(tmp_path)!r}))
        p.grad = torch.ones(100)
        opt.step()
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, timeout=300)
    assert not list(tmp_path.iterdir())


def test_stale_swap_files_of_a_killed_run_are_removed_at_next_start(tmp_path: Path) -> None:
    code = f"""
        import sys, time, torch
        from minispeed.offload import OffloadOptimizerConfig, SwappedOptimizer
        p = torch.nn.Parameter(torch.randn(100))
        opt = SwappedOptimizer([p], OffloadOptimizerConfig(device="nvme", nvme_path={str(tmp_path)!r}))
        p.grad = torch.ones(100)
        opt.step()
        print("ready", flush=True)
        time.sleep(300)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        stale = list(tmp_path.glob("minispeed-swap-*"))
        assert len(stale) == 1
        # While its owner lives, a new run leaves the directory alone.
        assert swapper_mod.clean_stale(tmp_path) == []
        proc.send_signal(signal.SIGKILL)  # a crash: no cleanup code runs
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert stale[0].exists()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    swapper_mod._log.addHandler(handler)
    try:
        opt, _ = _opt(tmp_path)  # the next start cleans it, and says so
    finally:
        swapper_mod._log.removeHandler(handler)
    assert not stale[0].exists()
    assert any(
        "removed stale swap files" in r.getMessage() and str(stale[0]) in r.getMessage()
        for r in records
    )
    assert len(list(tmp_path.glob("minispeed-swap-*"))) == 1  # only the new run's own
    opt.close()
