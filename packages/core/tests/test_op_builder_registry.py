"""The op registry lists every builder of every installed minispeed package."""

from __future__ import annotations

from pathlib import Path

import pytest

from minispeed.core.op_builder import OpBuilder, discover_builders, register_builder
from minispeed.core.ops.cast import CastBuilder, CastCudaBuilder


def test_core_ops_are_registered():
    registry = discover_builders()
    assert registry.builders["cast"] is CastBuilder
    assert registry.builders["cast_cuda"] is CastCudaBuilder
    assert registry.errors == {}


def test_registered_builder_appears_and_names_are_unique(tmp_path):
    class Extra(OpBuilder):
        name = "registry_extra_test"
        csrc_root = Path(tmp_path)
        sources = ("extra/extra.cpp",)

    assert register_builder(Extra) is Extra
    assert discover_builders().builders["registry_extra_test"] is Extra

    class Clash(OpBuilder):
        name = "registry_extra_test"
        csrc_root = Path(tmp_path)
        sources = ("clash/clash.cpp",)

    with pytest.raises(ValueError, match="already registered"):
        register_builder(Clash)
    with pytest.raises(TypeError, match="OpBuilder subclass"):
        register_builder(object)  # type: ignore[arg-type]


def test_builder_declaration_errors_name_the_fix():
    class NoSources(OpBuilder):
        name = "no_sources_test"
        csrc_root = Path(".")

    with pytest.raises(TypeError, match="sources"):
        NoSources()

    class NoRoot(OpBuilder):
        name = "no_root_test"
        sources = ("a.cpp",)

    with pytest.raises(TypeError, match="csrc_root"):
        NoRoot()
