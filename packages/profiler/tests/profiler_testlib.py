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
