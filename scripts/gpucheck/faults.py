"""Checks that misbehave on purpose, for the harness's own test (`tests/test_gpu_check.py`):
the driver must record each and go on. Run only with `--only fault.raise,...`."""

from __future__ import annotations

import os
import signal
import time


def raise_(ctx, report) -> None:
    """An exception inside a check: recorded as an error with its traceback."""
    report.info("before the error", 1.0)
    raise RuntimeError("planted failure")


def crash(ctx, report) -> None:
    """The worker dies mid-check (as a segfault in a kernel binding would)."""
    os.kill(os.getpid(), signal.SIGSEGV)


def hang(ctx, report) -> None:
    """A check that never returns: the driver kills it at its budget."""
    while True:
        time.sleep(1)


def ok(ctx, report) -> None:
    """A check that passes, to show the run went on after the three above."""
    report.check("one equals one", 0.0, 0.0)
