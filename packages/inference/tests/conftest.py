"""Shared helpers for minispeed.inference's tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """Norm-wise relative error ≤ `rel`, and every element within `rel · max|want|`."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().clamp_min(1e-30)
    err = (got - want).abs().max()
    assert err <= rel * scale, f"max abs error {err:.3e} > {rel} * max|want| ({scale:.3e})"
    denom = want.norm().clamp_min(1e-30)
    assert (got - want).norm() / denom <= rel


def load_example_gpt():
    """`examples/gpt.py` (minispeed's own GPT) as a module; it is not part of any package."""
    if "minispeed_example_gpt" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "minispeed_example_gpt", REPO / "examples/gpt.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["minispeed_example_gpt"] = module
        spec.loader.exec_module(module)
    return sys.modules["minispeed_example_gpt"]


@pytest.fixture
def gpt_module():
    """examples/gpt.py as a module."""
    return load_example_gpt()


@pytest.fixture
def rel_close():
    """`assert_rel_close(got, want, rel=1e-5)`."""
    return assert_rel_close
