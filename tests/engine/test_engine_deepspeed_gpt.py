"""A DeepSpeed GPT script runs under minispeed with only its import changed, and matches the
per-step losses DeepSpeed 0.19.8 recorded for it, at ZeRO stages 0-3.

The script (`scripts/ds_gpt.py`) takes its optimizer (AdamW) and scheduler (WarmupLR) from the
config, accumulates 2 micro-batches, clips at 1.0, saves a checkpoint mid-run and resumes it in
a fresh engine. It is launched as a user would launch it (torchrun, 2 gloo processes); the
reference is `fixtures/ds_gpt_losses.json`, recorded with the command stored in that file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "scripts" / "ds_gpt.py"
FIXTURE = json.loads((HERE / "fixtures" / "ds_gpt_losses.json").read_text())
STAGES = (0, 1, 2, 3)


def launch(script: Path, out: Path, *args: str, nproc: int = 2, timeout: float = 420) -> None:
    """Run `script` under torchrun on `nproc` local gloo processes; fail with its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("USE_DEEPSPEED", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        "--out",
        str(out),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


@pytest.fixture(scope="module")
def minispeed_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ds_gpt")
    launch(SCRIPT, out, "--stages", ",".join(map(str, STAGES)))
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_losses_match_deepspeed(minispeed_runs: Path, stage: int) -> None:
    for rank in (0, 1):
        ours = json.loads((minispeed_runs / f"stage{stage}_rank{rank}.json").read_text())
        ref = FIXTURE["runs"][f"stage{stage}_rank{rank}"]
        for key in ("losses", "after"):
            diffs = [abs(a - b) for a, b in zip(ours[key], ref[key], strict=True)]
            assert max(diffs) <= 1e-4, (stage, rank, key, ours[key], ref[key])
        assert abs(ours["eval_before"] - ref["eval_before"]) <= 1e-4
        assert ours["lr_after"] == pytest.approx(ref["lr_after"], rel=1e-12)


@pytest.mark.parametrize("stage", STAGES)
def test_save_load_round_trip(minispeed_runs: Path, stage: int) -> None:
    """Evaluation after loading equals evaluation before saving; training resumed from the
    checkpoint equals the uninterrupted run (weights, optimizer state, scheduler, counters)."""
    for rank in (0, 1):
        ours = json.loads((minispeed_runs / f"stage{stage}_rank{rank}.json").read_text())
        assert ours["eval_loaded"] == pytest.approx(ours["eval_before"], abs=1e-6)
        assert ours["after_loaded"] == pytest.approx(ours["after"], abs=1e-6)
        assert ours["lr_after_loaded"] == pytest.approx(ours["lr_after"], rel=1e-12)
        assert ours["client_state"] == {"note": "hello", "step": 6}
        assert ours["global_steps"] == FIXTURE["runs"][f"stage{stage}_rank{rank}"]["global_steps"]
