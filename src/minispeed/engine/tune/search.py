"""`minispeed tune`: find the fastest config for a training script by running short real jobs.

```bash
minispeed tune --budget 10m --nproc_per_node 2 examples/train_gpt.py --config examples/configs/zero2.json
```

The search, in DeepSpeed's autotuner's order, each step starting from the fastest config so far:

1. every ZeRO stage at the config's micro-batch (the config's own stage first: it is what the
   user runs today, and its result gives the model's size Ψ, L to the estimator);
2. the micro-batch doubled while it keeps getting faster (with `train_batch_size` in the config
   the global batch is kept: accumulation halves as the micro-batch doubles);
3. twice the accumulation (only when the config leaves the global batch free);
4. `reduce_bucket_size` (and stage 1-2's `allgather_bucket_size`) four times larger and smaller;
5. the optimizer offloaded to the CPU (stages 1-3).

Ranked by samples per second (the global batch over the measured step time), since a larger
micro-batch does more work per step. Before each trial the estimator
(`minispeed.zero.memory.modes`, DeepSpeed's figures) adds the model states of the candidate's
stage and offload mode to the activation bytes per sample measured so far; a candidate over the
per-device memory is rejected without running. A trial is a real job: `minispeed run` with
`MINISPEED_TRIAL` set, which the engine reads (`tune/trial.py`): the trial's config replaces
the script's, a few steps are timed, and the job ends. When a trial would not finish inside the
budget it is skipped. Outputs, in `--out`: `best_config.json` (the fastest config, a whole
ds_config), `trials.json` (every trial: its config changes and its measured step time and peak
memory, or why it was rejected, skipped or failed, with the error's last line), and one folder
per trial with its log. Cost: about `(start-up + steps × step time)` per trial, serially.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from minispeed.engine.cli.launcher import UsageError, strip_log_prefix
from minispeed.engine.tune.candidate import Candidate
from minispeed.engine.tune.memory import MemoryModel
from minispeed.engine.tune.trial import TRIAL_ENV, Trial

__all__ = ["Candidate", "Outcome", "TrialResult", "TuneReport", "parse_budget", "tune"]


def parse_budget(text: str) -> float:
    """Seconds in `"90s"`, `"10m"`, `"1.5h"` or `"600"`; zero, negative or garbage is an error."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([smh]?)\s*", text)
    if m is None:
        raise UsageError(f"--budget {text!r}: give a duration like 90s, 10m or 1h")
    seconds = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    if seconds <= 0:
        raise UsageError(f"--budget {text!r} leaves no time for a trial; give e.g. 10m")
    return seconds


class Outcome(Enum):
    """What became of a candidate."""

    MEASURED = "measured"
    REJECTED = "rejected"  # the estimator says it cannot fit: not run
    SKIPPED = "skipped"  # the budget would run out before it finished: not run
    FAILED = "failed"  # it ran and did not report


@dataclass
class TrialResult:
    """One row of the trials table."""

    candidate: Candidate
    outcome: Outcome
    phase: str
    step_seconds: float | None = None
    samples_per_second: float | None = None
    peak_memory_bytes: int | None = None
    reason: str = ""
    wall_seconds: float = 0.0
    #: The model's size as the trial's engine counted it (Ψ, L), for the estimator.
    num_params: int | None = None
    largest_layer_params: int | None = None


@dataclass
class TuneReport:
    """Every trial, the fastest, and the config written for it."""

    trials: list[TrialResult] = field(default_factory=list)
    best: TrialResult | None = None
    best_config: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        """The report as plain data (`trials.json`)."""

        def row(t: TrialResult) -> dict[str, Any]:
            d = asdict(t)
            d["candidate"], d["outcome"], d["label"] = (
                asdict(t.candidate),
                t.outcome.value,
                t.candidate.label,
            )
            return d

        return {
            "best": None if self.best is None else row(self.best),
            "trials": [row(t) for t in self.trials],
        }

    def table(self) -> Any:
        """The trials as a rich table, best first among the measured, then in trial order."""
        from rich.table import Table

        table = Table(title="minispeed tune: every trial", caption="ranked by samples/s")
        for col in ("#", "phase", "config", "outcome", "step", "samples/s", "peak mem", "why"):
            table.add_column(col, justify="right" if col in ("#", "step", "samples/s") else "left")
        style = {Outcome.MEASURED: "green", Outcome.FAILED: "red", Outcome.REJECTED: "yellow",
                 Outcome.SKIPPED: "dim"}  # fmt: skip
        for i, t in enumerate(self.trials):
            table.add_row(
                str(i),
                t.phase,
                t.candidate.label + (" [bold]*[/]" if t is self.best else ""),
                f"[{style[t.outcome]}]{t.outcome.value}[/]",
                "-" if t.step_seconds is None else f"{t.step_seconds * 1e3:,.1f} ms",
                "-" if t.samples_per_second is None else f"{t.samples_per_second:,.1f}",
                "-" if t.peak_memory_bytes is None else f"{t.peak_memory_bytes / 2**20:,.0f} MiB",
                t.reason,
            )
        return table


#: Runs one trial: (candidate's config, trial folder, seconds allowed) -> (result dict or None,
#: the error's last line). The subprocess runner is `run_trial`; tests may pass another.
TrialRunner = Callable[[dict[str, Any], Path, float], tuple[dict[str, Any] | None, str]]


@dataclass(frozen=True)
class TuneSettings:
    """What `tune` needs beyond the script."""

    base_config: dict[str, Any]
    world_size: int
    budget_seconds: float
    out_dir: Path
    device_memory_bytes: int
    num_params: int | None = None
    largest_layer_params: int | None = None


def tune(
    settings: TuneSettings,
    runner: TrialRunner,
    progress: Callable[[int, TrialResult], None] | None = None,
) -> TuneReport:
    """Search (see the module docstring) within the budget; write the outputs; return the report.

    `progress(index, result)` is called after each candidate (run, rejected or skipped)."""
    start = time.monotonic()
    report = TuneReport()
    memory = MemoryModel(
        settings.world_size,
        settings.device_memory_bytes,
        settings.num_params,
        settings.largest_layer_params,
    )
    base = _base_candidate(settings.base_config)
    fixed_batch = "train_batch_size" in settings.base_config
    seen: set[Candidate] = set()

    def attempt(c: Candidate, phase: str) -> TrialResult | None:
        if c in seen:
            return None
        seen.add(c)
        left = settings.budget_seconds - (time.monotonic() - start)
        typical = _typical_wall(report)
        if (why := memory.rejects(c)) is not None:  # the estimator's no stands on any budget
            t = TrialResult(c, Outcome.REJECTED, phase, reason=why)
        elif left <= 0 or (typical is not None and typical > left):
            t = TrialResult(c, Outcome.SKIPPED, phase, reason=_skip_reason(left, typical))
        else:
            t = _run_one(c, phase, settings, runner, left, len(report.trials))
            if t.outcome is Outcome.MEASURED:
                memory.learn(c, t.peak_memory_bytes or 0, asdict(t))
        report.trials.append(t)
        if progress is not None:
            progress(len(report.trials) - 1, t)
        return t

    def best() -> TrialResult | None:
        measured = [t for t in report.trials if t.outcome is Outcome.MEASURED]
        return max(measured, key=lambda t: t.samples_per_second or 0.0, default=None)

    for stage in [base.stage, *(s for s in range(4) if s != base.stage)]:
        attempt(replace(base, stage=stage, offload_optimizer=False), "ZeRO stage")
    for c in _phases(best, fixed_batch):
        attempt(*c)
    report.best = best()
    for t in report.trials:
        if t.outcome is Outcome.MEASURED and t is not report.best and report.best is not None:
            slower = 1 - (t.samples_per_second or 0) / (report.best.samples_per_second or 1)
            t.reason = (
                f"{slower:.0%} fewer samples/s than the best ({t.samples_per_second:,.1f} vs "
                f"{report.best.samples_per_second:,.1f})"
            )
    if report.best is not None:
        report.best.reason = "fastest"
        report.best_config = report.best.candidate.config(settings.base_config, settings.world_size)
    _write_outputs(report, settings.out_dir)
    return report


def _phases(
    best: Callable[[], TrialResult | None], fixed_batch: bool
) -> Iterator[tuple[Candidate, str]]:
    """Phases 2-5, each from the best so far (read when the phase starts)."""
    if best() is None:
        return  # nothing ran: no config to start from

    def current() -> Candidate:
        b = best()
        assert b is not None  # only grows once a trial has been measured
        return b.candidate

    c = current()
    while True:  # 2. micro-batch, doubled while it helps
        if fixed_batch and c.grad_accum % 2:
            break
        nxt = replace(
            c,
            micro_batch=c.micro_batch * 2,
            grad_accum=c.grad_accum // 2 if fixed_batch else c.grad_accum,
        )
        yield nxt, "micro-batch"
        now = best()
        if now is None or now.candidate != nxt:
            break
        c = nxt
    c = current()
    if not fixed_batch:  # 3. accumulation
        yield replace(c, grad_accum=c.grad_accum * 2), "accumulation"
    c = current()
    for factor in (4, 0.25):  # 4. buckets
        yield (
            replace(
                c,
                reduce_bucket=max(1, int(c.reduce_bucket * factor)),
                allgather_bucket=max(1, int(c.allgather_bucket * factor)),
            ),
            "buckets",
        )
    c = current()
    if c.stage >= 1:  # 5. offload
        yield replace(c, offload_optimizer=True), "offload"


def _base_candidate(cfg: dict[str, Any]) -> Candidate:
    from minispeed.engine.config import EngineConfig

    resolved = EngineConfig.from_ds_config(cfg, data_parallel_size=1)
    return Candidate(
        stage=resolved.zero.stage,
        micro_batch=resolved.micro_batch_size,
        grad_accum=resolved.gradient_accumulation_steps,
        reduce_bucket=resolved.zero.reduce_bucket_numel,
        allgather_bucket=resolved.zero.allgather_bucket_numel,
        offload_optimizer=resolved.zero.offload_optimizer is not None,
    )


def _typical_wall(report: TuneReport) -> float | None:
    ran = [t.wall_seconds for t in report.trials if t.outcome in (Outcome.MEASURED, Outcome.FAILED)]
    return None if not ran else sum(ran) / len(ran)


def _skip_reason(left: float, typical: float | None) -> str:
    return f"budget spent: {max(left, 0):.0f} s left, a trial takes ~{typical or 0:.0f} s"


def _run_one(
    c: Candidate, phase: str, s: TuneSettings, runner: TrialRunner, left: float, index: int
) -> TrialResult:
    folder = s.out_dir / "trials" / f"{index:02d}-{c.label.replace(' ', '-')}"
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    result, error = runner(c.config(s.base_config, s.world_size), folder, left)
    wall = time.monotonic() - t0
    if result is None:
        return TrialResult(c, Outcome.FAILED, phase, reason=error, wall_seconds=wall)
    return TrialResult(
        c,
        Outcome.MEASURED,
        phase,
        step_seconds=result["step_seconds"],
        samples_per_second=result["samples_per_second"],
        peak_memory_bytes=result["peak_memory_bytes"],
        wall_seconds=wall,
        num_params=result.get("num_params"),
        largest_layer_params=result.get("largest_layer_params"),
    )


def _write_outputs(report: TuneReport, out: Path) -> None:
    from minispeed.engine.tune.trial import write_json_atomic

    write_json_atomic(out / "trials.json", report.as_json())
    if report.best_config is not None:
        write_json_atomic(out / "best_config.json", report.best_config)


def run_trial(
    script: str,
    script_args: Sequence[str],
    nproc_per_node: int,
    steps: int,
    warmup_steps: int,
) -> TrialRunner:
    """The real runner: `minispeed run --nproc_per_node N script args` with `MINISPEED_TRIAL`."""

    def run(config: dict[str, Any], folder: Path, seconds: float) -> tuple[dict | None, str]:
        trial = Trial(config, steps, warmup_steps, folder / "result.json")
        trial.write(folder / "trial.json")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env[TRIAL_ENV] = str(folder / "trial.json")
        argv = [sys.executable, "-m", "minispeed.engine.cli", "run",
                "--nproc_per_node", str(nproc_per_node), script, *script_args]  # fmt: skip
        with open(folder / "log.txt", "w") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                code = proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: our session
                proc.wait()
                return None, f"timed out after {seconds:.0f} s (the budget's end)"
        if trial.result.is_file() and code == 0:
            return json.loads(trial.result.read_text()), ""
        text = (folder / "log.txt").read_text(errors="replace")
        if code == 0:
            return None, (
                f"the script ended before step {steps} without a result; does it call "
                f"engine.step() {steps} times?"
            )
        return None, f"exit code {code}: {last_error_line(text)}"

    return run


def last_error_line(log: str) -> str:
    """The last `SomeError: message` line of a log (a traceback's last line), else its last line."""
    lines = [strip_log_prefix(line).strip() for line in log.splitlines() if line.strip()]
    pattern = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")
    for line in reversed(lines):
        if pattern.match(line):
            return line
    return lines[-1] if lines else "(no output)"
