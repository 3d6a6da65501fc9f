"""Run a DeepSpeed script kept under scripts/ with only its import lines changed to minispeed's.

`load(path, {old_line: new_line})` executes the script's source with each `old_line` replaced
(each must occur exactly once: a script that drifts from its recorded form fails loudly) under a
module name that is not `__main__`, so its recording block does not run; the test then calls
its `main()`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

PIPE_IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec\n": (
        "from minispeed.engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec\n"
    ),
}

MOE_IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.moe.layer import MoE\n": "from minispeed.engine.moe.layer import MoE\n",
    "from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer\n": (
        "from minispeed.engine.moe.utils import split_params_into_different_moe_groups_for_optimizer\n"
    ),
}

CLASSIC_IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed import comm as dist\n": "from minispeed.engine import comm as dist\n",
}

RESUME_IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n": (
        "from minispeed.engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n"
    ),
}

LOOP_UTILS_IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.runtime.lr_schedules import WarmupLR\n": (
        "from minispeed.engine.runtime.lr_schedules import WarmupLR\n"
    ),
    "from deepspeed.utils import RepeatingLoader, log_dist\n": (
        "from minispeed.engine.utils import RepeatingLoader, log_dist\n"
    ),
}

PLAIN_IMPORTS = {"import deepspeed\n": "import minispeed.engine as deepspeed\n"}

FROZEN_RESUME_IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n": (
        "from minispeed.engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n"
    ),
}

CHAT_IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam\n": (
        "from minispeed.engine.ops.adam import DeepSpeedCPUAdam, FusedAdam\n"
    ),
    "from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus\n": (
        "from minispeed.engine.runtime.zero.partition_parameters import ZeroParamStatus\n"
    ),
}


def load(script: str, imports: dict[str, str]) -> types.ModuleType:
    """The script `scripts/<script>` with its imports swapped, executed as a module."""
    path = ROOT / "scripts" / script
    source = path.read_text()
    for old, new in imports.items():
        count = source.count(old)
        assert count == 1, f"{script}: expected the line {old!r} once, found it {count} times"
        source = source.replace(old, new)
    module = types.ModuleType(f"ds_script_{path.stem}")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def assert_matches(ours: Any, ref: Any, rel: float = 1e-5, path: str = "") -> None:
    """`ours` equals DeepSpeed's record `ref` key by key: numbers where either is a float within
    `rel` (relative, absolute near zero), everything else exactly; the failure names the path."""
    if isinstance(ref, dict):
        assert isinstance(ours, dict) and set(ours) == set(ref), (path, ours, ref)
        for key in ref:
            assert_matches(ours[key], ref[key], rel, f"{path}/{key}")
    elif isinstance(ref, list):
        assert isinstance(ours, list) and len(ours) == len(ref), (path, ours, ref)
        for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
            assert_matches(a, b, rel, f"{path}[{i}]")
    elif isinstance(ref, float) or isinstance(ours, float):
        # A number (DeepSpeed's get_lr() gives int 0 where a schedule starts at 0).
        assert not isinstance(ours, bool) and isinstance(ours, int | float), (path, ours, ref)
        assert abs(ours - ref) <= rel * max(1.0, abs(ref)), (path, ours, ref)
    else:
        assert ours == ref and type(ours) is type(ref), (path, ours, ref)


RUNNER = Path(__file__).resolve().parent / "scripts" / "run_recorder.py"


def run_recorder(
    scripts: list[str], out: Path, *, launcher: list[str] | None = None, timeout: float = 900
) -> list[dict[str, Any]]:
    """Run each `scripts/<script>`'s `main` unchanged, one after the other, on 2 processes
    (torchrun, or `launcher`: the command that starts the runner, e.g. `accelerate launch
    --config_file ...`) with this venv's `deepspeed` (minispeed's deepspeed_compat); per rank,
    in rank order, `{script: its result}`."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = launcher or [sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc_per_node=2"]  # fmt: skip
    proc = subprocess.run(
        [*start, str(RUNNER), *scripts, str(out)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
