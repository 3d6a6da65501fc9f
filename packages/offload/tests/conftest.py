"""Shared fixtures: the SIMD paths to test (every level this build and CPU run, plus the reference)."""

from __future__ import annotations

import pytest

from minispeed.offload import cpu_optim


def _paths() -> list[str]:
    return [f"simd{level}" for level in cpu_optim.simd_levels()] + ["reference"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "path" in metafunc.fixturenames:
        metafunc.parametrize("path", _paths())
