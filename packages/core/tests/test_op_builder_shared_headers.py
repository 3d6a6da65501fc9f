"""Core's shared C++ headers reach every op: on its include path and in its cache key.

See Note [shared headers] in `minispeed.core.op_builder.builder`. These tests compute include
paths and cache keys only; nothing is compiled.
"""

from __future__ import annotations

import shutil

from minispeed.core.op_builder import SHARED_INCLUDE_DIR, OpBuilder, SimdLevel, discover_builders
from minispeed.core.op_builder import builder as builder_module


def _builders() -> dict[str, type[OpBuilder]]:
    builders = discover_builders().builders
    assert {"cast", "cast_cuda"} <= builders.keys(), "core's own ops must be discovered"
    return builders


def _keys(builders: dict[str, type[OpBuilder]]) -> dict[str, str]:
    """Each op's cache key from a fresh builder (keys are memoized per instance), level fixed."""
    return {name: cls(simd=SimdLevel.SCALAR).fingerprint() for name, cls in builders.items()}


def test_shared_header_ships_in_core_and_every_op_includes_it():
    assert (SHARED_INCLUDE_DIR / "minispeed" / "simd.h").is_file()
    assert SHARED_INCLUDE_DIR.parent.name == "csrc", "it ships beside core's op sources"
    for name, cls in _builders().items():
        paths = cls().include_paths()
        assert SHARED_INCLUDE_DIR in paths, f"op {name!r} lacks core's include dir: {paths}"
        # The op's own folders come first, so an op's header shadows a shared one of that name.
        assert paths[-1] == SHARED_INCLUDE_DIR


def test_editing_the_shared_header_changes_every_op_cache_key(tmp_path, monkeypatch):
    builders = _builders()
    before = _keys(builders)

    copy = tmp_path / "include"
    shutil.copytree(SHARED_INCLUDE_DIR, copy)
    monkeypatch.setattr(builder_module, "SHARED_INCLUDE_DIR", copy)
    assert _keys(builders) == before, (
        "the same headers in another directory must give the same keys (worktrees share builds)"
    )

    header = copy / "minispeed" / "simd.h"
    header.write_text(header.read_text() + "\n// edited\n")
    edited = _keys(builders)
    unchanged = sorted(name for name in builders if edited[name] == before[name])
    assert not unchanged, (
        f"editing minispeed/simd.h must rebuild every op; these would not: {unchanged}"
    )

    (copy / "minispeed" / "more.h").write_text("#pragma once\n")
    added = _keys(builders)
    assert all(added[name] != edited[name] for name in builders), "a new shared header counts too"
