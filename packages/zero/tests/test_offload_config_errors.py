"""The offload sections through `ZeroConfig.from_section` and `zero.shard`: translated with
DeepSpeed's keys when minispeed-offload is installed, an error naming the install command when it
is not, and bad values refused at `shard()` on every rank with the key and the fix.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from zero_testlib import make_model

import minispeed.zero as zero
from minispeed.core.testing import run_distributed

offload = pytest.importorskip("minispeed.offload")


def test_sections_are_translated_with_deepspeed_keys(tmp_path) -> None:
    cfg = zero.ZeroConfig.from_section(
        {
            "stage": 3,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(tmp_path),
                "buffer_count": 3,
                "pin_memory": False,
                "pipeline": True,
            },
            "offload_param": {
                "device": "cpu",
                "buffer_size": 1e6,
                "max_in_cpu": 2e6,
                "buffer_count": 4,
            },
        },
        aio={"block_size": 262144, "queue_depth": 16, "thread_count": 2},
    )
    assert cfg.offload_optimizer == offload.OffloadOptimizerConfig(
        device="nvme",
        nvme_path=str(tmp_path),
        buffer_count=3,
        pipeline_read=True,
        pipeline_write=True,
    )
    assert cfg.offload_param == offload.OffloadParamConfig(
        device="cpu", buffer_numel=1_000_000, max_in_cpu_numel=2_000_000, buffer_count=4
    )
    assert cfg.aio == offload.AioConfig(block_bytes=262144, queue_depth=16, thread_count=2)


@pytest.mark.parametrize(
    "section,match",
    [
        (
            {"stage": 2, "offload_optimizer": {"device": "nvme"}},
            "^zero_optimization.offload_optimizer.nvme_path: must be given with device 'nvme'",
        ),
        (
            {"stage": 2, "offload_optimizer": {"device": "gpu"}},
            "^zero_optimization.offload_optimizer.device: 'gpu'.*use one of",
        ),
        (
            {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_cnt": 2}},
            "^zero_optimization.offload_optimizer.buffer_cnt: .*buffer_count",
        ),
        (  # a key three levels deep keeps its parents, even with the device off
            {"stage": 2, "offload_optimizer": {"devise": "cpu"}},
            "^zero_optimization.offload_optimizer.devise: unknown key .did you mean 'device'",
        ),
    ],
)
def test_bad_sections_name_the_key(section, match) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        zero.ZeroConfig.from_section(section)


@pytest.mark.parametrize("blocked", [False, True], ids=["offload", "no-offload-package"])
def test_a_ds_config_offload_the_stage_cannot_honour_is_ignored_with_a_warning(
    blocked, monkeypatch, caplog
) -> None:
    """As DeepSpeed ignores them (DeepSpeed-Chat asks for both at every stage); the same
    section built in code is refused."""
    if blocked:
        monkeypatch.setitem(sys.modules, "minispeed.offload", None)
    from minispeed.core.logging import get_logger

    monkeypatch.setattr(get_logger(), "propagate", True)  # let caplog see minispeed's records
    both = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    at_zero = zero.ZeroConfig.from_section({"stage": 0, **both}, path=f"z{blocked}")
    # at stage 2 the optimizer's is honoured (it needs the package, which the next test covers)
    at_two = zero.ZeroConfig.from_section(
        {"stage": 2, **(both if not blocked else {"offload_param": both["offload_param"]})},
        path=f"z{blocked}",
    )
    assert (at_zero.offload_optimizer, at_zero.offload_param, at_two.offload_param) == (None,) * 3
    assert (at_two.offload_optimizer is None) == blocked
    warned = [r.getMessage() for r in caplog.records]
    for key, stage in (("offload_optimizer", 0), ("offload_param", 0), ("offload_param", 2)):
        line = f"z{blocked}.{key}.device: 'cpu' is ignored at stage {stage}, as DeepSpeed"
        assert any(m.startswith(line) for m in warned), (line, warned)
    if blocked:
        return
    with pytest.raises(ValueError, match=r"offload_param\.device: 'cpu' needs stage 3"):
        zero.ZeroConfig(stage=2, offload_param=offload.OffloadParamConfig(device="cpu"))


def test_without_the_offload_package_the_error_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "minispeed.offload", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install packages/zero\[offload\]"):
        zero.ZeroConfig.from_section({"stage": 2, "offload_optimizer": {"device": "cpu"}})
    # device 'none' never needs the package
    cfg = zero.ZeroConfig.from_section({"stage": 2, "offload_param": {"device": "none"}})
    assert cfg.offload_param is None


def test_zero_does_not_import_offload_unless_asked() -> None:
    code = (
        "import sys, minispeed.zero as z;"
        "z.ZeroConfig.from_section({'stage': 3});"
        "assert 'minispeed.offload' not in sys.modules, 'imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _shard_errors(rank: int, world_size: int, root: str) -> dict[str, str]:
    """shard() under each bad section; the message each rank got."""
    missing = os.path.join(root, "does-not-exist")
    cases = {
        "nvme_path_missing": {
            "stage": 2,
            "offload_optimizer": {"device": "nvme", "nvme_path": missing},
        },
        "buffer_size_too_small": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {"device": "nvme", "nvme_path": root, "buffer_size": 100},
        },
        "pin_memory_impossible": {
            "stage": 1,
            "offload_optimizer": {"device": "nvme", "nvme_path": root, "pin_memory": True},
        },
        "not_adam": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    }
    import minispeed.offload.swapper as swapper

    def refuse(t, key):  # what mlock says when RLIMIT_MEMLOCK is too low (root can always lock)
        raise MemoryError(f"{key}.pin_memory=true: page-locking failed: set {key}.pin_memory false")

    real_mlock, swapper._mlock = swapper._mlock, refuse
    out = {}
    try:
        for name, section in cases.items():
            model = make_model()
            cfg = zero.ZeroConfig.from_section(section)
            kind = torch.optim.SGD if name == "not_adam" else torch.optim.AdamW
            try:
                zero.shard(model, kind(model.parameters(), lr=0.1), config=cfg)
                out[name] = "no error"
            except (RuntimeError, ValueError, TypeError, OSError, MemoryError) as err:
                out[name] = str(err)
    finally:
        swapper._mlock = real_mlock  # the worker process serves later tests too
    return out


def test_bad_values_fail_at_shard_on_every_rank(tmp_path) -> None:
    per_rank = run_distributed(_shard_errors, world_size=2, args=(str(tmp_path),), timeout_s=180)
    for got in per_rank:
        assert "offload_optimizer.nvme_path" in got["nvme_path_missing"]
        assert "does not exist" in got["nvme_path_missing"]
        assert "offload_param.buffer_size=100" in got["buffer_size_too_small"]
        assert "raise offload_param.buffer_size to at least" in got["buffer_size_too_small"]
        assert "offload_optimizer.pin_memory" in got["pin_memory_impossible"]
        assert "torch.optim.Adam, AdamW or Adagrad" in got["not_adam"]
        assert "got SGD" in got["not_adam"]
