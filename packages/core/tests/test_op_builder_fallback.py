"""When an op cannot be built, callers get the pure-PyTorch reference and exactly one warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from minispeed.core.logging import get_logger
from minispeed.core.op_builder import (
    CACHE_ENV,
    DISABLE_ENV,
    SIMD_ENV,
    OpBuilder,
    OpBuildError,
    load_or_fallback,
    ops_disabled,
    requested_simd_level,
)
from minispeed.core.ops import cast

pytestmark = pytest.mark.timeout(300)

TINY_CPP = r"""
#include <pybind11/pybind11.h>
int add(int a, int b) { return a + b; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""


@pytest.fixture
def warnings_seen():
    """WARNING records of the ``minispeed`` logger (it does not propagate to pytest's caplog)."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(level=logging.WARNING)
    logger = get_logger()
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _builder(
    root: Path, name: str, source: str = TINY_CPP, flags: tuple[str, ...] = ()
) -> OpBuilder:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "op.cpp").write_text(source)

    class Builder(OpBuilder):
        sources = (f"{name}/op.cpp",)
        uses_simd = False
        uses_openmp = False
        extra_cxx_flags = flags

    Builder.name = name
    return Builder(csrc_root=root)


def _assert_one_fallback_warning(records: list[logging.LogRecord], op: str) -> str:
    messages = [r.getMessage() for r in records if f"op {op!r}" in r.getMessage()]
    assert len(messages) == 1, f"expected one warning for {op}, got {messages}"
    assert "pure-PyTorch reference" in messages[0]
    return messages[0]


def test_missing_source_is_incompatible_and_falls_back_once(tmp_path, monkeypatch, warnings_seen):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))

    class Missing(OpBuilder):
        name = "missing_source_test"
        csrc_root = tmp_path
        sources = ("missing/op.cpp",)

    builder = Missing()
    ok, why = builder.is_compatible()
    assert not ok and "missing/op.cpp" in why
    with pytest.raises(OpBuildError, match=r"missing/op\.cpp"):
        builder.load()
    assert load_or_fallback(builder) is None
    assert load_or_fallback(builder) is None
    _assert_one_fallback_warning(warnings_seen, "missing_source_test")


def test_bad_flag_raises_build_error_once_then_falls_back(tmp_path, monkeypatch, warnings_seen):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    builder = _builder(tmp_path, "bad_flag_test", flags=("-fminispeed-no-such-flag",))
    assert builder.is_compatible() == (True, "")
    with pytest.raises(OpBuildError) as first:
        builder.load()
    assert "build failed" in first.value.reason
    assert "-fminispeed-no-such-flag" in str(first.value)
    with pytest.raises(OpBuildError) as second:
        builder.load()
    assert second.value is first.value, "a failed build must not be retried in the same process"
    assert not builder.is_cached()
    assert load_or_fallback(builder) is None
    assert load_or_fallback(builder) is None
    _assert_one_fallback_warning(warnings_seen, "bad_flag_test")


def test_compile_error_names_the_error(tmp_path, monkeypatch, warnings_seen):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    # No includes before the error, so the compiler stops in well under a second.
    builder = _builder(tmp_path, "compile_error_test", source="int broken( {\n")
    assert load_or_fallback(builder) is None
    message = _assert_one_fallback_warning(warnings_seen, "compile_error_test")
    assert "error" in message.lower()


def test_disable_env_parsing(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert not ops_disabled("cast")
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert ops_disabled("cast") and ops_disabled("anything")
    monkeypatch.setenv(DISABLE_ENV, "quantize, cast")
    assert ops_disabled("cast") and not ops_disabled("cast_cuda")
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert not ops_disabled("cast")


def test_disabled_cast_returns_reference_bits_with_one_warning(monkeypatch, warnings_seen):
    monkeypatch.setenv(DISABLE_ENV, "cast")
    x = torch.tensor([1.0, 1.00390625, float("nan"), -0.0, 3.4e38, 1e-40])
    expected = cast.reference.float_to_bf16(x).view(torch.int16)
    for _ in range(2):
        got = cast.float_to_bf16(x)
        assert torch.equal(got.view(torch.int16), expected)
    flat = cast.flatten([x, x[:2]], dtype=torch.bfloat16)
    assert torch.equal(flat.view(torch.int16)[:6], expected)
    _assert_one_fallback_warning(warnings_seen, "cast")


def test_invalid_simd_override_names_the_choices(monkeypatch):
    monkeypatch.setenv(SIMD_ENV, "sse9")
    with pytest.raises(ValueError, match=r"avx2.*avx512.*scalar"):
        requested_simd_level()
