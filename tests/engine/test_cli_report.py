"""`minispeed report --config`: every key the engine reads, with its value and its source (given,
derived, default); and `--help` on every subcommand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from minispeed.core.sections import is_alias, is_unsupported
from minispeed.engine.cli.resolved import resolved_rows
from minispeed.engine.config import EngineConfig
from minispeed.engine.config.schema import config_schema

DS = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
}


def _rows(ds, world=2) -> dict[str, tuple]:
    return {
        k: (v, s)
        for k, v, s in resolved_rows(EngineConfig.from_ds_config(ds, data_parallel_size=world))
    }


def test_each_key_has_its_value_and_source() -> None:
    rows = _rows(DS)
    assert rows["train_micro_batch_size_per_gpu"] == (4, "given")
    assert rows["train_batch_size"] == (8, "derived")  # "auto": 4 x 1 x 2 ranks
    assert rows["gradient_accumulation_steps"] == (1, "derived")
    assert rows["zero_optimization.reduce_bucket_size"] == (1000, "given")
    assert rows["zero_optimization.overlap_comm"] == (False, "derived")  # off at stage 2 only
    assert rows["zero_optimization.contiguous_gradients"] == (True, "default")
    assert rows["bf16.enabled"] == (True, "given")
    assert rows["(precision).param_dtype"] == ("bfloat16", "derived")
    assert rows["wall_clock_breakdown"] == (False, "default")
    assert _rows({**DS, "zero_optimization": {"stage": 3}})["zero_optimization.overlap_comm"] == (
        True,
        "default",
    )


def test_every_key_the_engine_reads_is_listed() -> None:
    listed = {k.split(".")[0] for k in _rows(DS)}
    read = {
        k for k, v in config_schema()["properties"].items()
        if not is_unsupported(v) and not is_alias(v)
    }  # fmt: skip
    assert read <= listed
    zero = config_schema()["properties"]["zero_optimization"]["properties"]
    flat = {
        k
        for k, v in zero.items()
        if not v.get("properties") and not is_unsupported(v) and not is_alias(v)
    }
    assert {f"zero_optimization.{k}" for k in flat} <= set(_rows(DS))


def test_a_key_three_levels_deep_keeps_its_parents() -> None:
    """Issue 32.7: `zero_optimization.offload_optimizer.device`, not `offload_optimizer.device`;
    every key of the nested section is listed, given or not."""
    rows = _rows({**DS, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert rows["zero_optimization.offload_optimizer.device"] == ("cpu", "given")
    assert rows["zero_optimization.offload_optimizer.buffer_count"] == (4, "default")
    assert rows["zero_optimization.offload_param.device"] == ("none", "default")
    assert not any(k.startswith("offload_optimizer") for k in rows)


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minispeed.engine.cli", *argv],
        capture_output=True,
        text=True,
        timeout=180,
        env={"COLUMNS": "200", **__import__("os").environ},
    )


def test_report_prints_the_resolved_table(tmp_path) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(DS))
    proc = _cli("report", "--config", str(cfg), "--world-size", "2")
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout[proc.stdout.index("resolved config") :]
    line = next(x for x in table.splitlines() if "train_batch_size" in x)
    assert "8" in line and "derived" in line


@pytest.mark.parametrize(
    ("sub", "words"),
    [("run", "--nproc_per_node"), ("report", "--config"), ("config", "schema"),
     ("estimate", "--gpu-mem"), ("tune", "--budget"), ("consolidate", "--to deepspeed-universal"),
     ("trace", "usage")],
)  # fmt: skip
def test_help_on_every_subcommand(sub, words) -> None:
    proc = _cli(sub, "--help")
    assert proc.returncode == 0 and words in proc.stdout, proc.stdout + proc.stderr
