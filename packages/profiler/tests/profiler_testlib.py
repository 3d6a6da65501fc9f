"""The GPT of examples/gpt.py (GPT-2 recipe: causal SDPA, GELU MLP, tied head), loaded by path."""

import importlib.util
import sys
from pathlib import Path

import pytest

GPT_FILE = Path(__file__).resolve().parents[3] / "examples" / "gpt.py"


def load_gpt():
    """The examples/gpt.py module; skips when the repository's examples are not beside us."""
    if not GPT_FILE.exists():
        pytest.skip(f"{GPT_FILE} not found (the profiler installed without the repository)")
    name = "minispeed_example_gpt"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, GPT_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def overlapping_slices(trace):
    """Pairs of slices on one track of a merged trace that overlap without one containing the
    other (a track a viewer cannot draw as a stack); empty when every track nests properly.
    Times in integer nanoseconds, 1 ns of rounding allowed."""
    by_track = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            start = round(float(e["ts"]) * 1000)
            by_track.setdefault((e["pid"], e["tid"]), []).append(
                (start, start + round(float(e["dur"]) * 1000), e["name"])
            )
    bad = []
    for track, slices in by_track.items():
        stack = []
        for start, end, name in sorted(slices, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start + 1:
                stack.pop()
            if stack and end > stack[-1][1] + 1:
                bad.append((track, stack[-1][2], name))
            stack.append((start, end, name))
    return bad
