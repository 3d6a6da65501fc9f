"""Shared helpers for minispeed.tensor_parallel's tests (used in the parent process only: bodies
run on workers, which load just their own test file)."""

from __future__ import annotations

import pytest
import torch

from minispeed.comm import costs as comm_costs


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """Every element within `rel · max|want|` (1e-5: fp32 sums taken in another order)."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().clamp_min(1e-30)
    err = (got - want).abs().max()
    assert err <= rel * scale, f"max abs error {err:.3e} > {rel} * max|want| ({scale:.3e})"


def assert_bytes(records: list[tuple[str, int, int, str]], want: list, n: int) -> None:
    """The logged collectives `(op, msg_bytes, wire_bytes, impl)` equal the formula's list
    (`costs.Collective`s, compared as multisets), and each one's wire bytes follow from its size."""
    got = sorted((op, msg) for op, msg, _, _ in records)
    assert got == sorted((c.op, c.msg_bytes) for c in want), f"logged {got}"
    for op, msg, wire, impl in records:
        assert wire == comm_costs.wire_bytes(op, msg, n, impl=impl)


@pytest.fixture
def rel_close():
    """`assert_rel_close(got, want, rel=1e-5)`."""
    return assert_rel_close


@pytest.fixture
def logged_bytes():
    """`assert_bytes(records, formula, n)`."""
    return assert_bytes
