"""``python -m minispeed.core.report`` prints the environment and every registered op's status."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minispeed.core.accelerator import get_accelerator
from minispeed.core.op_builder import DISABLE_ENV
from minispeed.core.report import environment, op_statuses

pytestmark = pytest.mark.timeout(180)


def test_report_command_lists_environment_and_cast_op():
    proc = subprocess.run(
        [sys.executable, "-m", "minispeed.core.report"],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr
    for needle in ("torch", "nvcc", "SIMD level", "gloo", "cast", "cast_cuda", "built (cached)"):
        assert needle in proc.stdout, f"{needle!r} missing from the report:\n{proc.stdout}"


def test_op_statuses_explain_why_not():
    rows = {row.name: row for row in op_statuses()}
    assert {"cast", "cast_cuda"} <= rows.keys()
    if get_accelerator().name == "cpu":
        cuda = rows["cast_cuda"]
        assert not cuda.compatible and "GPU" in cuda.reason
    cpu = rows["cast"]
    assert cpu.compatible == (cpu.reason == ""), "an incompatible op must say why"


def test_disabled_op_is_marked(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "cast")
    assert "disabled" in {row.name: row for row in op_statuses()}["cast"].reason


def test_environment_reports_comm_backends_and_simd():
    env = environment()
    assert "gloo yes" in env["comm backends"]
    assert env["SIMD level"].split()[0] in {"avx512", "avx2", "scalar"}
