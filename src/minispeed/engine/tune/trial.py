"""The engine's side of a `minispeed tune` trial: an unmodified training script learns from one
environment variable that it is a trial, runs a few steps with the trial's config, reports its
step time and peak memory to a file, and ends.

```text
MINISPEED_TRIAL=/tmp/tune/trial-03/trial.json  ->  {"config": {...the whole ds_config...},
                                                    "steps": 6, "warmup_steps": 2,
                                                    "result": "/tmp/tune/trial-03/result.json"}
```

`initialize()` reads it (`Trial.from_env`): the trial's config replaces the one the script passes,
and the engine gets a `TrialRecorder`. At each accumulation boundary the recorder notes the time;
after `warmup_steps` untimed steps it times `steps - warmup_steps` more, then every rank agrees on
the slowest rank's mean step time and the largest peak memory (two all-reduces), rank 0 writes
the result file (temp name, fsync, rename), the process group is destroyed and the process exits
with code 0 (`SystemExit`), whatever the script would have done next. This is DeepSpeed's
autotuner design (its engine stops at `end_profile_step`), written so that the script needs no
change: a script that calls `initialize()` and `engine.step()` is tunable. Cost: one clock read
per step; two 8-byte all-reduces, once.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.core.accelerator import get_accelerator
from minispeed.core.files import atomic_write_json

__all__ = ["TRIAL_ENV", "Trial", "TrialRecorder", "write_json_atomic"]

#: The environment variable naming a trial's description file.
TRIAL_ENV = "MINISPEED_TRIAL"


@dataclass(frozen=True)
class Trial:
    """One trial as the tuner describes it (see the module docstring for the file)."""

    config: dict[str, Any]
    steps: int
    warmup_steps: int
    result: Path

    @classmethod
    def from_env(cls) -> Trial | None:
        """The trial `MINISPEED_TRIAL` names, or None when the variable is unset."""
        path = os.environ.get(TRIAL_ENV)
        if not path:
            return None
        try:
            raw = json.loads(Path(path).read_text())
            trial = cls(
                dict(raw["config"]),
                int(raw["steps"]),
                int(raw["warmup_steps"]),
                Path(raw["result"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RuntimeError(
                f"{TRIAL_ENV}={path!r} does not name a readable trial file ({e}); it is set by "
                f"`minispeed tune`: unset it to run the script normally"
            ) from None
        if not 0 <= trial.warmup_steps < trial.steps:
            raise RuntimeError(
                f"trial file {path}: need 0 <= warmup_steps < steps, got "
                f"{trial.warmup_steps} and {trial.steps}"
            )
        return trial

    def write(self, path: Path) -> None:
        """Write this trial's description file (the tuner's side)."""
        write_json_atomic(
            path,
            {
                "config": self.config,
                "steps": self.steps,
                "warmup_steps": self.warmup_steps,
                "result": str(self.result),
            },
        )


class TrialRecorder:
    """Times the trial's steps and ends the job after the last (see the module docstring)."""

    def __init__(self, trial: Trial, module: nn.Module) -> None:
        self.trial = trial
        # The model's size, counted before any partitioning (the tuner's estimator needs Ψ, L).
        self.num_params = sum({id(p): p.numel() for p in module.parameters()}.values())
        self.largest_layer = max(
            sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules()
        )
        self._timed_from: float | None = None

    def on_boundary(self, engine: Any) -> None:
        """Called by `Engine.step` at each accumulation boundary, after the optimizer step (the
        engine's `StepObserver` protocol)."""
        global_steps, train_batch_size = engine.global_steps, engine.train_batch_size()
        if global_steps == self.trial.warmup_steps:
            get_accelerator().synchronize()
            self._timed_from = time.perf_counter()
        if global_steps < self.trial.steps:
            return
        get_accelerator().synchronize()
        timed = self.trial.steps - self.trial.warmup_steps
        start = self._timed_from if self._timed_from is not None else time.perf_counter()
        mine = torch.tensor(
            [
                (time.perf_counter() - start) / timed,
                float(get_accelerator().max_memory_allocated()),
            ],
            dtype=torch.float64,
            device=get_accelerator().device(),
        )
        comm.all_reduce(mine, op=comm.ReduceOp.MAX)  # the slowest rank sets the pace
        step_s, peak = mine.tolist()
        if comm.get_rank() == 0:
            write_json_atomic(
                self.trial.result,
                {
                    "step_seconds": step_s,
                    "samples_per_second": train_batch_size / step_s,
                    "peak_memory_bytes": int(peak),
                    "num_params": self.num_params,
                    "largest_layer_params": self.largest_layer,
                    "world_size": comm.get_world_size(),
                    "timed_steps": timed,
                },
            )
        comm.barrier()
        comm.destroy_process_group()
        raise SystemExit(0)  # the trial is over: the rest of the script is not the tuner's


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as JSON, whole or not at all (`minispeed.core.files`), creating the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, obj)
