"""`make gpu-check` (scripts/gpu_check.py) on a machine without a GPU: the dry run goes end to end.

The GPU check is written to run once, in a few minutes of a lent device, so it must be proven
here first: every check runs on the CPU at tiny sizes through the same code (CUDA-only parts
reported as skipped, with the reason), the JSON and the table are written, and the table is
printed. A second run plants a check that raises, one that crashes its worker and one that hangs,
and the run must record each and go on to the next.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))

from gpucheck import CHECKS  # noqa: E402

pytestmark = pytest.mark.timeout(660)


def _run(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(
        # 26 s of CPU; the budget is generous for a loaded machine (190 s seen at load 25)
        [sys.executable, str(SCRIPT), "--dry-run", "--budget-s", "600", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=640,
    )
    return proc, json.loads((out / "gpu_check.json").read_text())


def test_the_dry_run_runs_every_check_and_prints_its_table(tmp_path):
    proc, doc = _run(tmp_path)
    checks = {c["name"]: c for c in doc["checks"]}
    assert list(checks) == [s.name for s in CHECKS]
    bad = {n: (c["status"], c.get("error")) for n, c in checks.items() if c["status"] != "pass"}
    assert not bad, f"{bad}\n{(tmp_path / 'gpu_check.log').read_text()[-3000:]}"
    assert proc.returncode == 0
    assert doc["meta"]["mode"] == "dry run on CPU"
    table = (tmp_path / "gpu_check.md").read_text()
    assert table in proc.stdout and proc.stdout.rstrip().splitlines()[-1].startswith("  speed.")
    # every CUDA op check ran its wrappers on the CPU and says why the kernel part did not run
    for name in ("op.cast", "op.compression", "op.moe_permute", "op.inference"):
        rows = checks[name]["rows"]
        assert any(r["kind"] == "skip" and "no GPU" in r["note"] for r in rows), name
        assert any(r["kind"] == "check" and r["ok"] for r in rows), name
    # the training parity ran every stage against plain PyTorch
    whats = " ".join(r["what"] for r in checks["train.zero"]["rows"])
    for label in ("ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-Offload (stage 2"):
        assert label in whats
    # and parking the states between steps (DeepSpeed's offload_states) changed no loss
    parks = [r for r in checks["train.zero"]["rows"] if "parked between steps" in r["what"]]
    assert len(parks) == 2 and all(r["ok"] for r in parks), parks


def test_a_check_that_raises_crashes_or_hangs_is_recorded_and_the_run_goes_on(tmp_path):
    proc, doc = _run(tmp_path, "--only", "fault.raise,fault.crash,fault.hang,fault.ok")
    got = {c["name"]: c for c in doc["checks"]}
    assert [got[n]["status"] for n in ("fault.raise", "fault.crash", "fault.hang", "fault.ok")] == [
        "error", "crashed", "timeout", "pass"
    ]  # fmt: skip
    assert "planted failure" in got["fault.raise"]["traceback"]
    assert got["fault.raise"]["rows"][0]["what"] == "before the error"  # kept what it recorded
    assert "exit status -11" in got["fault.crash"]["error"]
    assert proc.returncode == 1
