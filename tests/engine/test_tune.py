"""`minispeed tune`: the search order, the estimator's rejections, failures with their last
line, the budget; and a real search over the demo's GPT on this machine, whose best config is
at least as fast as the best ZeRO stage at the config's micro-batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minispeed.engine.cli.launcher import UsageError
from minispeed.engine.tune import (
    Candidate,
    Outcome,
    TuneSettings,
    last_error_line,
    parse_budget,
    tune,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "train_gpt.py"
BASE = json.loads((ROOT / "examples" / "configs" / "zero2.json").read_text())


def _fake_runner(speed, fail=(), sleep=0.0):
    """A runner whose samples/s is `speed(candidate config)`; `fail` stages raise."""

    def run(config, folder, seconds):
        time.sleep(sleep)
        zero = config["zero_optimization"]
        if zero["stage"] in fail:
            return None, "exit code 1: RuntimeError: stage 1 cannot do that"
        mb = config["train_micro_batch_size_per_gpu"]
        sps = speed(config)
        return {
            "step_seconds": 2 * mb * config["gradient_accumulation_steps"] / sps,
            "samples_per_second": sps,
            "peak_memory_bytes": 100 * 2**20 + mb * 2**20,  # activations: 1 MiB per sample
            "num_params": 346_944,
            "largest_layer_params": 37_248,
        }, ""

    return run


def _settings(tmp_path, **kw) -> TuneSettings:
    defaults = {"base_config": BASE, "world_size": 2, "budget_seconds": 60, "out_dir": tmp_path,
                "device_memory_bytes": 64 * 2**30}  # fmt: skip
    return TuneSettings(**{**defaults, **kw})


def test_search_order_and_why_each_lost(tmp_path) -> None:
    def speed(cfg):  # stage 3 fastest; micro-batch 32 helps, 64 does not; offload hurts
        z = cfg["zero_optimization"]
        mb = cfg["train_micro_batch_size_per_gpu"]
        base = {0: 100, 1: 110, 2: 120, 3: 130}[z["stage"]]
        return base * {16: 1.0, 32: 1.5, 64: 1.2}[mb] * (0.5 if "offload_optimizer" in z else 1)

    report = tune(_settings(tmp_path), _fake_runner(speed, fail=(1,)))
    rows = [(t.phase, t.candidate.label, t.outcome) for t in report.trials]
    assert [r[1].split()[0] for r in rows[:4]] == ["z2", "z0", "z1", "z3"]  # config's stage first
    assert rows[2][2] is Outcome.FAILED and "RuntimeError: stage 1" in report.trials[2].reason
    assert [r[1] for r in rows[4:6]] == ["z3 mb32 ga1 rb100000", "z3 mb64 ga1 rb100000"]
    assert report.best.candidate == Candidate(3, 32, 1, 100000, 100000, False)
    assert rows[-1][0] == "offload" and "offload" in rows[-1][1]
    for t in report.trials:
        if t.outcome is Outcome.MEASURED and t is not report.best:
            assert "fewer samples/s than the best" in t.reason
    written = json.loads((tmp_path / "best_config.json").read_text())
    assert written["zero_optimization"]["stage"] == 3
    assert written["train_micro_batch_size_per_gpu"] == 32
    table = json.loads((tmp_path / "trials.json").read_text())
    assert len(table["trials"]) == len(report.trials) and table["best"]["reason"] == "fastest"


def test_the_estimator_rejects_what_cannot_fit(tmp_path) -> None:
    # 1 GiB per device; activations measured at ~1 MiB per sample: stage 0 (20 bytes x Ψ =
    # 6.6 MiB) fits, but no micro-batch above ~900 does.
    cfg = {**BASE, "train_micro_batch_size_per_gpu": 512}
    report = tune(
        _settings(tmp_path, base_config=cfg, device_memory_bytes=2**30),
        _fake_runner(lambda c: 100.0),
    )
    rejected = [t for t in report.trials if t.outcome is Outcome.REJECTED]
    assert rejected and all(t.candidate.micro_batch == 1024 for t in rejected)
    assert "estimator:" in rejected[0].reason and "> 1.00 GiB per device" in rejected[0].reason


def test_a_spent_budget_skips_trials(tmp_path) -> None:
    report = tune(_settings(tmp_path, budget_seconds=0.5), _fake_runner(lambda c: 100.0, sleep=0.2))
    skipped = [t for t in report.trials if t.outcome is Outcome.SKIPPED]
    assert skipped and all("budget spent" in t.reason for t in skipped)
    assert sum(t.outcome is Outcome.MEASURED for t in report.trials) in (2, 3)


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("10m", 600), ("1.5h", 5400), ("45", 45)]
)
def test_budget_parsing(text, seconds) -> None:
    assert parse_budget(text) == seconds


@pytest.mark.parametrize("text", ["0", "0m", "-5m", "ten minutes", ""])
def test_a_zero_or_bad_budget_is_refused(text) -> None:
    with pytest.raises(UsageError, match="--budget"):
        parse_budget(text)


def test_last_error_line() -> None:
    log = "step 1\nTraceback (most recent call last):\n  File x\nValueError: bad lr\nW1125 shutdown"
    assert last_error_line(log) == "ValueError: bad lr"


def _cli(*argv: str, timeout: float = 280) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "minispeed.engine.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--budget", "0", str(DEMO), "--config", "CFG"], "leaves no time"),
        (["--budget", "1m", "no_such.py", "--config", "CFG"], "does not exist"),
        (["--budget", "1m", str(DEMO)], "--config cfg.json"),
        (["--budget", "1m", "--nproc_per_node", "0", str(DEMO), "--config", "CFG"], ">= 1"),
        ([str(DEMO), "--config", "CFG"], "--budget 10m"),
    ],
)
def test_tune_bad_input_exits_2_before_any_trial(tmp_path, argv, words) -> None:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(BASE))
    out = tmp_path / "out"
    proc = _cli("tune", "--out", str(out), *[str(cfg) if a == "CFG" else a for a in argv])
    assert proc.returncode == 2 and words in proc.stderr, proc.stdout + proc.stderr
    assert not (out / "trials").exists()


@pytest.mark.timeout(300)
def test_tune_the_demo_gpt_on_this_machine(tmp_path) -> None:
    """A real search, 75 seconds: each trial is `minispeed run` of the unmodified demo script.
    Every ZeRO stage gets a row (measured, or skipped when the budget would run out)."""
    proc = _cli(
        "tune", "--budget", "75s", "--nproc_per_node", "2", "--trial-steps", "3",
        "--warmup-steps", "1", "--out", str(tmp_path), str(DEMO),
        "--config", str(ROOT / "examples" / "configs" / "zero2.json"),
        "--no-progress", "--no-checkpoint", "--eval-batches", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads((tmp_path / "trials.json").read_text())
    best = table["best"]
    stages = [t for t in table["trials"] if t["phase"] == "ZeRO stage"]
    assert len(stages) == 4
    measured = [t for t in stages if t["outcome"] == "measured"]
    assert measured, table
    assert best["samples_per_second"] >= max(t["samples_per_second"] for t in measured)
    for t in table["trials"]:
        assert t["reason"], t  # every row says why it lost (or that it is the fastest)
    written = json.loads((tmp_path / "best_config.json").read_text())
    assert written["zero_optimization"]["stage"] == best["candidate"]["stage"]
    assert "fastest:" in proc.stdout


@pytest.mark.timeout(200)
def test_a_real_failed_trial_reports_the_errors_last_line(tmp_path) -> None:
    from minispeed.engine.tune import run_trial

    cfg = str(ROOT / "examples" / "configs" / "zero2.json")  # the script reads it too
    runner = run_trial(str(DEMO), ["--config", cfg, "--no-progress"], 1, 3, 1)
    bad = {**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_sise": 10}}
    result, error = runner(bad, tmp_path, 150)
    assert result is None
    assert error.startswith("exit code 1: minispeed.core.config.ConfigError:"), error
    assert "reduce_bucket_sise" in error and "reduce_bucket_size" in error  # did-you-mean
