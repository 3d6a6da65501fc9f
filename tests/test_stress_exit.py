"""Ten 2-rank runs of a script whose last collectives are on tensors it drops at once exit
cleanly (issue 32 §1): `scripts/stress_exit.py`'s smallest case, 5 runs at a time (a load of
their own). The full harness (stages 1 and 3, the trace tool, a DeepSpeed-style script under
torchrun, a parallel CPU load) is the script itself; the mechanism it found is tested call by
call in packages/comm/tests/test_handoff_exit.py (Note [the backend lets go before we do])."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "stress_exit.py"


def test_ten_two_rank_runs_exit_cleanly() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, str(SCRIPT), "--cases", "comm", "--runs", "10", "--parallel", "5",
           "--load", "0", "--steps", "2"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "comm         ok   10  abort    0  other    0" in out.stdout, out.stdout
