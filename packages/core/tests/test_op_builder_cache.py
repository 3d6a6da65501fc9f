"""OpBuilder's cache: one build per variant, then every load (this process or another) imports it.

A tiny pybind11-only op (no torch headers: builds in seconds) exercises the mechanism in a
private cache directory, so these tests never touch the user's cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minispeed.core.op_builder import CACHE_ENV, OpBuilder, SimdLevel

pytestmark = pytest.mark.timeout(600)

TINY_CPP = r"""
#include <pybind11/pybind11.h>
int add(int a, int b) { return a + b; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add", &add); }
"""

# The same builder, declared in a child process: same name, flags and files -> same cache entry.
LOAD_SCRIPT = """
import json, sys
from pathlib import Path
from minispeed.core.op_builder import OpBuilder

class TinyBuilder(OpBuilder):
    name = "tiny_cache_test"
    csrc_root = Path(sys.argv[1])
    sources = ("tiny/tiny.cpp",)
    uses_simd = False
    uses_openmp = False
    extra_cxx_flags = ("-O0",)  # nothing to optimize; compile faster

builder = TinyBuilder()
module = builder.load()
record = builder.last_load
print(json.dumps({"sum": module.add(2, 3), "built": record.built, "seconds": record.seconds,
                  "dir": str(record.cache_dir)}))
"""


def _tiny_builder_cls(root: Path) -> type[OpBuilder]:
    class TinyBuilder(OpBuilder):
        name = "tiny_cache_test"
        csrc_root = root
        sources = ("tiny/tiny.cpp",)
        uses_simd = False
        uses_openmp = False
        extra_cxx_flags = ("-O0",)  # nothing to optimize; compile faster

    return TinyBuilder


def _write_tiny(root: Path) -> Path:
    (root / "tiny").mkdir(parents=True, exist_ok=True)
    (root / "tiny" / "tiny.cpp").write_text(TINY_CPP)
    (root / "load_tiny.py").write_text(LOAD_SCRIPT)
    return root


def _start_loader(root: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, CACHE_ENV: str(cache)}
    return subprocess.Popen(
        [sys.executable, str(root / "load_tiny.py"), str(root)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=500)
    assert proc.returncode == 0, f"loader process failed:\n{err}"
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two processes load the tiny op at once into an empty private cache (one build in all).

    Returns (csrc root, cache root, the two processes' results).
    """
    root = _write_tiny(tmp_path_factory.mktemp("csrc"))
    cache = tmp_path_factory.mktemp("cache")
    procs = [_start_loader(root, cache) for _ in range(2)]
    return root, cache, [_result(p) for p in procs]


def test_concurrent_processes_build_once(built):
    """Ranks loading an unbuilt op together: one compiles under the lock, the other waits, imports."""
    _, _, results = built
    assert [r["sum"] for r in results] == [5, 5]
    assert sorted(r["built"] for r in results) == [False, True]
    assert results[0]["dir"] == results[1]["dir"]


def test_later_process_loads_from_cache_without_rebuilding(built, monkeypatch):
    root, cache, results = built
    monkeypatch.setenv(CACHE_ENV, str(cache))
    cache_dir = Path(results[0]["dir"])
    library = next(cache_dir.glob("*.so"))
    mtime_before = library.stat().st_mtime_ns

    builder = _tiny_builder_cls(root)()
    assert builder.is_cached()
    module = builder.load()
    record = builder.last_load
    assert module.add(2, 3) == 5
    assert record.cache_dir == cache_dir
    assert not record.built, "a later process must import the cached .so, not compile"
    assert record.seconds < 5.0
    assert library.stat().st_mtime_ns == mtime_before
    assert builder.load() is module, "a second load in the same process must return the same module"


def test_cache_dir_is_root_torch_version_and_op_hash(built, monkeypatch):
    root, cache, results = built
    monkeypatch.setenv(CACHE_ENV, str(cache))
    cache_dir = _tiny_builder_cls(root)().cache_dir()
    assert str(cache_dir) == results[0]["dir"]
    assert cache_dir.parent == cache / torch.__version__
    name, _, digest = cache_dir.name.rpartition("-")
    assert name == "tiny_cache_test" and len(digest) == 16
    assert (cache_dir / "minispeed_build.json").is_file()


def test_cache_key_changes_with_sources_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    root = _write_tiny(tmp_path / "csrc")

    class SimdTiny(OpBuilder):
        name = "tiny_key_test"
        csrc_root = root
        sources = ("tiny/tiny.cpp",)

    avx2_dir = SimdTiny(simd=SimdLevel.AVX2).cache_dir()
    scalar_dir = SimdTiny(simd=SimdLevel.SCALAR).cache_dir()
    assert avx2_dir != scalar_dir, "each SIMD level needs its own cache entry"
    assert SimdTiny(simd=SimdLevel.SCALAR).cache_dir() == scalar_dir, "the key must be stable"

    (root / "tiny" / "tiny.cpp").write_text(TINY_CPP + "\n// edited\n")
    assert SimdTiny(simd=SimdLevel.SCALAR).cache_dir() != scalar_dir, (
        "an edited source must rebuild"
    )

    (root / "tiny" / "extra.h").write_text("#pragma once\n")
    edited = SimdTiny(simd=SimdLevel.SCALAR).cache_dir()
    (root / "tiny" / "extra.h").write_text("#pragma once\n#define X 1\n")
    assert SimdTiny(simd=SimdLevel.SCALAR).cache_dir() != edited, (
        "a header beside the source counts"
    )


def test_a_build_killed_half_way_does_not_hang_the_next_one(tmp_path, monkeypatch):
    """Note [a build killed half-way]: torch's baton (`lock`) left in the build directory by a
    killed builder made every later build wait forever; now it is removed and the op builds."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    root = _write_tiny(tmp_path / "csrc")
    builder = _tiny_builder_cls(root)()
    cache_dir = builder.cache_dir()
    cache_dir.mkdir(parents=True)
    (cache_dir / "lock").touch()  # what a builder killed between its start and its end leaves
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, str(root / "load_tiny.py"), str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # the old code waits here until killed
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["sum"] == 5
    assert "left by a build that was killed half-way" in out.stderr
