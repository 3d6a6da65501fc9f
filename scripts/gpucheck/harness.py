"""What every check shares: the record it fills (`Report`), the run's context (`Ctx`), tolerances,
the relative error, a timer, and the allocator poison.

A check is `fn(ctx, report)`: it computes on `ctx.device` and records rows in `report`:

- `report.check(what, value, limit)`: a correctness measurement; the check fails when
  `value > limit` (or is NaN);
- `report.goal(what, value, goal)`: a timing against the issue's goal; missing it is shown,
  never a failure;
- `report.info(what, value)`: a number with no limit (a ratio, a build time);
- `report.skip(what, reason)`: a part that cannot run here ("skipped: no GPU ...");
- `report.finding(text)`: something minispeed cannot do on CUDA yet, said plainly.

Errors are ‖out − ref‖ / ‖ref‖ in float64 against the reference computed on the CPU in float64
(METHOD: fp32 arithmetic lands far below 1e-3, bf16 operands between 1e-3 and 1e-2; NaN never
passes). Inputs are fresh random draws, never zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib.util
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

#: Relative-error limits by the arithmetic of the code under test (see the module docstring).
TOL = {
    "exact": 0.0,  # bit-for-bit contracts (the cast op, packed sign bits)
    "fp32": 1e-5,  # fp32 kernels against a float64 reference
    "fp32-train": 1e-4,  # fp32 losses after several optimizer steps (orders of summation differ)
    "bf16": 1e-2,
}

NO_GPU = "skipped: no GPU (dry run on CPU)"


@dataclasses.dataclass
class Row:
    """One measurement of a check."""

    what: str
    kind: str  # "check" | "goal" | "info" | "skip"
    value: float | str | None = None
    limit: float | None = None  # check: the tolerance; goal: the target
    unit: str = ""
    ok: bool | None = None
    note: str = ""


class Report:
    """The rows and findings one check records (see the module docstring)."""

    def __init__(self, name: str, dry_run: bool = False) -> None:
        self.name = name
        self.dry_run = dry_run  # goals are not judged on the CPU at tiny sizes
        self.rows: list[Row] = []
        self.findings: list[str] = []
        self.facts: dict[str, Any] = {}  # extra JSON-only detail (flags, shapes, versions)

    def check(self, what: str, value: float, limit: float, unit: str = "rel err", note: str = ""):
        """A correctness row: ok when `value <= limit` (NaN is never ok)."""
        value = float(value)
        ok = not math.isnan(value) and value <= limit
        self.rows.append(Row(what, "check", value, limit, unit, ok, note))
        return ok

    def goal(
        self,
        what: str,
        value: float,
        goal: float,
        unit: str = "",
        higher_is_better: bool = True,
        note: str = "",
    ) -> bool:
        """A row measured against the issue's target; a miss is reported, not failed (in the
        dry run the row is information only)."""
        value = float(value)
        if self.dry_run:
            self.info(what, value, unit, note=(note + "; " if note else "") + "goal not judged")
            return True
        ok = value >= goal if higher_is_better else value <= goal
        self.rows.append(Row(what, "goal", value, goal, unit, ok, note))
        return ok

    def fail(self, what: str, why: str) -> None:
        """A correctness row that could not even be measured (a build or launch failed)."""
        self.rows.append(Row(what, "check", "failed", None, "", False, why))

    def info(self, what: str, value: float | str, unit: str = "", note: str = "") -> None:
        """A row with no limit."""
        self.rows.append(Row(what, "info", value, None, unit, None, note))

    def skip(self, what: str, reason: str = NO_GPU) -> None:
        """A part that cannot run here, with the reason."""
        self.rows.append(Row(what, "skip", None, None, "", None, reason))

    def finding(self, text: str) -> None:
        """Something minispeed cannot do on CUDA yet (or does differently than it should)."""
        self.findings.append(text)

    def status(self) -> str:
        """fail > finding > below goal > pass; skipped when nothing ran."""
        if any(r.kind == "check" and not r.ok for r in self.rows):
            return "fail"
        if self.findings:
            return "finding"
        if any(r.kind == "goal" and not r.ok for r in self.rows):
            return "below goal"
        if self.rows and all(r.kind == "skip" for r in self.rows):
            return "skipped"
        return "pass"

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "findings": list(self.findings),
            "facts": self.facts,
        }


class Ctx:
    """The run: the device, whether this is the CPU dry run, where scratch files go."""

    def __init__(self, dry_run: bool, scratch: Path) -> None:
        import torch

        from minispeed.core.accelerator import get_accelerator

        self.acc = get_accelerator()
        self.gpu = self.acc.name == "cuda"
        self.dry_run = dry_run or not self.gpu
        self.device = torch.device("cuda", self.acc.current_device_index()) if self.gpu else None
        self.device = self.device or torch.device("cpu")
        self.scratch = scratch
        self.scratch.mkdir(parents=True, exist_ok=True)

    def pick(self, gpu: Any, dry: Any) -> Any:
        """A size: `gpu` on the device, `dry` in the dry run."""
        return dry if self.dry_run else gpu

    def sync(self) -> None:
        self.acc.synchronize()

    def timed(self, fn: Callable[[], object], reps: int = 10, warmup: int = 3) -> float:
        """Median seconds of `fn` over `reps` calls after `warmup` calls (device events on a
        GPU, so only the device's work between them counts)."""
        reps, warmup = (max(2, reps // 4), 1) if self.dry_run else (reps, warmup)
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            start, end = self.acc.Event(enable_timing=True), self.acc.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def wall(self, fn: Callable[[], object], reps: int = 5, warmup: int = 1) -> float:
        """Median wall seconds of `fn`, synchronizing the device around each call (for work
        that waits on the host: generation loops, CPU optimizer steps)."""
        reps, warmup = (max(1, reps // 3), 1) if self.dry_run else (reps, warmup)
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def poison(self, nbytes: int) -> None:
        """Fill `nbytes` of the device allocator's cache with NaN and free it, so that an output
        a kernel leaves unwritten reads NaN (and fails its check) instead of stale numbers."""
        if not self.gpu:
            return
        import torch

        blob = torch.full((nbytes // 4 + 1,), float("nan"), device=self.device)
        del blob

    @functools.cached_property
    def matmul_flops(self) -> float:
        """The chip's bf16 matmul rate (FLOP/s), measured now on random data: 8192³ products
        on a GPU (the mean of ten after three warm-ups, METHOD's recipe), 512³ in fp32 on a CPU."""
        import torch

        n, dtype = (512, torch.float32) if self.dry_run else (8192, torch.bfloat16)
        a = torch.randn(n, n, device=self.device, dtype=dtype)
        b = torch.randn(n, n, device=self.device, dtype=dtype)
        seconds = self.timed(lambda: a @ b, reps=10, warmup=3)
        return 2 * n**3 / seconds

    def free(self) -> None:
        """Drop what the last check left in the allocator; reset the peak counter."""
        gc.collect()
        self.acc.empty_cache()
        self.acc.reset_peak_memory_stats()


def rel_err(out: Any, ref: Any) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 on the CPU (inf when `out` holds NaN or inf; the plain
    norm of `out` when `ref` is zero)."""
    out = out.detach().to("cpu", copy=True).double()
    ref = ref.detach().to("cpu", copy=True).double()
    if out.shape != ref.shape:
        raise ValueError(f"shapes differ: {tuple(out.shape)} against {tuple(ref.shape)}")
    if out.numel() == 0:
        return 0.0
    if not bool(out.isfinite().all()):
        return math.inf
    denom = float(ref.norm())
    diff = float((out - ref).norm())
    return diff / denom if denom > 0 else diff


def max_abs_diff(out: Any, ref: Any) -> float:
    """max |out − ref| in float64 (integers compared exactly)."""
    out, ref = out.detach().cpu(), ref.detach().cpu()
    if out.numel() == 0:
        return 0.0
    return float((out.double() - ref.double()).abs().max())


@functools.cache
def gpt_module() -> Any:
    """`examples/gpt.py` (the GPT every minispeed example trains), loaded by path."""
    name = "minispeed_example_gpt"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def compiled_or_reason(builder: Any) -> tuple[Any, str]:
    """`(module, "")` when `builder`'s op loads (builds if needed), else `(None, why)`.

    Checks call this before comparing an op with its reference: the public wrappers fall back
    to the reference silently-but-once when a build fails, which would make the comparison
    reference against reference.
    """
    from minispeed.core.op_builder import OpBuildError, ops_disabled

    if ops_disabled(builder.name):
        return None, f"disabled by MINISPEED_DISABLE_OPS={os.environ.get('MINISPEED_DISABLE_OPS')}"
    try:
        return builder.load(), ""
    except OpBuildError as err:
        return None, f"build failed: {err.reason}"
