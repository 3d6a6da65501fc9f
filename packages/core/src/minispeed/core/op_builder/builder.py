"""`OpBuilder`: declare a C++/CUDA op once, JIT-build it once, load it from a cache ever after.

An op is a folder of sources (`csrc/<op>/*.cpp`, `*.cu`) inside the package that owns it,
plus a small subclass of `OpBuilder` naming them:

```python
class CastBuilder(OpBuilder):
    name = "cast"
    csrc_root = Path(__file__).parent.parent / "csrc"   # this package's csrc/
    sources = ("cast/cast.cpp",)
```

`CastBuilder().load()` returns the compiled Python module. See Note [op cache layout] (in
`.cache`) for where it lives and Note [one builder per machine] for how concurrent ranks share
one build.

Costs: the first build of an op runs the compiler (seconds for a pybind11-only source, about a
minute for one that includes `torch/extension.h`);
every later `load()` in any process imports the cached `.so` (milliseconds), and in the same
process returns the memoized module (a dict lookup).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import torch

from minispeed.core.logging import get_logger
from minispeed.core.op_builder import toolchain
from minispeed.core.op_builder.cache import (
    LIB_SUFFIX,
    LOCK_FILE,
    MARKER,
    file_lock,
    import_extension,
    op_cache_root,
    write_json_atomic,
)
from minispeed.core.op_builder.simd import (
    SIMD_ENV,
    SimdLevel,
    missing_cpu_flags,
    requested_simd_level,
    simd_flags,
)

__all__ = ["SHARED_INCLUDE_DIR", "VERBOSE_ENV", "LoadRecord", "OpBuildError", "OpBuilder"]

VERBOSE_ENV = "MINISPEED_OP_VERBOSE"
_HASHED_SUFFIXES = frozenset({".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"})

#: Core's shared C++ headers (`minispeed/simd.h`, ...). See Note [shared headers].
SHARED_INCLUDE_DIR = Path(__file__).resolve().parent.parent / "csrc" / "include"

# Note [shared headers]
# Helpers that several ops need (the SIMD level enum, bf16/fp16 conversions, dot/axpy; see
# csrc/include/minispeed/simd.h) live once, in core's csrc/include, which ships inside
# minispeed-core as package data like every csrc/ file. Every builder puts that directory on its
# include path (after the op's own folders), so any package's source may
# `#include "minispeed/simd.h"`; and every builder hashes the directory's files into its cache
# key, so editing a shared header rebuilds every op on its next load. The files are hashed under
# their path relative to that directory (not the absolute path), so checkouts in different places
# with the same headers share cached builds, as they do for the op's own sources.

_log = get_logger("op_builder")


class OpBuildError(RuntimeError):
    """An op could not be built or loaded here. `reason` is one line; `str()` adds details."""

    def __init__(self, op: str, reason: str, details: str = "") -> None:
        self.op = op
        self.reason = reason
        self.details = details
        message = f"op {op!r}: {reason}"
        super().__init__(f"{message}\n{details}" if details else message)

    def __reduce__(self) -> tuple[type, tuple[str, str, str], dict]:
        # Pickled with the constructor's arguments (an error raised in a worker process reaches
        # its parent through pickle; `args` holds only the joined message), then its attributes.
        return type(self), (self.op, self.reason, self.details), self.__dict__


@dataclasses.dataclass(frozen=True)
class LoadRecord:
    """How this process got an op: built it now, or imported it from the cache."""

    module_name: str
    cache_dir: Path
    built: bool  # True: the compiler ran in this process; False: the cached .so was imported
    seconds: float  # wall time of the build or of the import


# Per-process memo: cache dir -> (module, record) and cache dir -> the error of a failed build,
# so a broken op is tried once per process, not on every call of its wrapper.
_loaded: dict[Path, tuple[ModuleType, LoadRecord]] = {}
_failed: dict[Path, OpBuildError] = {}
_process_lock = threading.RLock()


class OpBuilder:
    """One JIT-compiled op: its sources, its flags, where it can run. Subclass and set the ClassVars.

    Override `is_compatible` to add op-specific requirements (call `super()` first), and
    `cxx_flags` / `nvcc_flags` for flags that depend on the machine.
    """

    #: Op name: the key in the registry, in `MINISPEED_DISABLE_OPS` and in the cache path.
    name: ClassVar[str] = ""
    #: The owning package's `csrc` directory; `sources` are relative to it.
    csrc_root: ClassVar[Path | None] = None
    #: Source files (`.cpp`, `.cu`) relative to `csrc_root`; one must define the pybind module
    #: as `PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)`.
    sources: ClassVar[tuple[str, ...]] = ()
    #: Extra include directories relative to `csrc_root` (each op's own folder is implied).
    include_dirs: ClassVar[tuple[str, ...]] = ()
    #: Flags appended after the builder's defaults.
    extra_cxx_flags: ClassVar[tuple[str, ...]] = ()
    extra_nvcc_flags: ClassVar[tuple[str, ...]] = ()
    extra_ld_flags: ClassVar[tuple[str, ...]] = ()
    #: Compile the C++ sources for the SIMD level (`-mavx512f ... -DMINISPEED_SIMD_AVX512`).
    uses_simd: ClassVar[bool] = True
    #: Compile and link with OpenMP (needed for `at::parallel_for` to use several threads).
    uses_openmp: ClassVar[bool] = True

    def __init__(self, *, csrc_root: Path | None = None, simd: SimdLevel | None = None) -> None:
        if not self.name:
            raise TypeError(f"{type(self).__name__} must set the class attribute `name`")
        root = csrc_root if csrc_root is not None else type(self).csrc_root
        if root is None:
            raise TypeError(
                f"{type(self).__name__} has no csrc_root: set the class attribute or pass csrc_root="
            )
        if not self.sources:
            raise TypeError(f"{type(self).__name__} must list its `sources`")
        self.root = Path(root)
        # None: decided at each call from MINISPEED_SIMD / the CPU (see simd.py).
        self._simd = simd
        self._fingerprints: dict[tuple[str, ...], str] = {}

    # -- what and how to compile ------------------------------------------------------------
    @property
    def requires_cuda(self) -> bool:
        """Whether the op has `.cu` sources (then it needs nvcc and a GPU)."""
        return any(s.endswith(".cu") for s in self.sources)

    def simd_level(self) -> SimdLevel:
        """The SIMD level this builder compiles for (the constructor's, else `MINISPEED_SIMD`/CPU)."""
        return self._simd if self._simd is not None else requested_simd_level()

    def source_paths(self) -> list[Path]:
        """Absolute paths of `sources`."""
        return [self.root / s for s in self.sources]

    def include_paths(self) -> list[Path]:
        """Absolute include directories: each source's folder, `include_dirs`, then core's shared
        headers (`SHARED_INCLUDE_DIR`, see Note [shared headers])."""
        dirs = dict.fromkeys(p.parent for p in self.source_paths())
        dirs.update(dict.fromkeys(self.root / d for d in self.include_dirs))
        dirs[SHARED_INCLUDE_DIR] = None  # a module global, read per call
        return list(dirs)

    def cxx_flags(self) -> list[str]:
        """Host compiler flags: -O3, OpenMP, the SIMD level's flags, then `extra_cxx_flags`."""
        flags = ["-O3"]
        if self.uses_openmp:
            flags.append("-fopenmp")
        if self.uses_simd:
            flags += simd_flags(self.simd_level())
        return flags + list(self.extra_cxx_flags)

    def nvcc_flags(self) -> list[str]:
        """nvcc flags: -O3 and one `-gencode` per visible GPU arch, then `extra_nvcc_flags`."""
        flags = ["-O3"]
        for arch in toolchain.cuda_device_arches():
            num = arch.replace(".", "")
            flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        return flags + list(self.extra_nvcc_flags)

    def ld_flags(self) -> list[str]:
        """Linker flags: OpenMP when used, then `extra_ld_flags`."""
        return (["-fopenmp"] if self.uses_openmp else []) + list(self.extra_ld_flags)

    # -- can it be built here? --------------------------------------------------------------
    def is_compatible(self) -> tuple[bool, str]:
        """`(True, "")` when this machine can build and run the op, else `(False, why + fix)`."""
        missing = [s for s, p in zip(self.sources, self.source_paths()) if not p.is_file()]
        if missing:
            return False, (
                f"sources {missing} not found under {self.root}: the package was installed "
                "without its csrc/ files (they must ship as package data)"
            )
        if toolchain.cxx_compiler() is None:
            cxx = os.environ.get("CXX", "c++")
            return False, f"no C++ compiler {cxx!r} on PATH: install g++ or set CXX"
        if toolchain.find_ninja() is None:
            return False, "ninja not found: pip install ninja"
        if self.uses_simd:
            lacking = missing_cpu_flags(self.simd_level())
            if lacking:
                return False, (
                    f"built for {self.simd_level().label} but this CPU lacks {lacking}: "
                    f"set {SIMD_ENV}=avx2 or {SIMD_ENV}=scalar"
                )
        if self.requires_cuda:
            if not toolchain.cuda_device_arches():
                return False, "CUDA op needs a GPU, and the accelerator here is the CPU"
            if torch.version.cuda is None:
                return False, f"torch {torch.__version__} has no CUDA support: install a CUDA build"
            if toolchain.find_nvcc() is None:
                return (
                    False,
                    "nvcc not found on PATH or in $CUDA_HOME/bin: install the CUDA toolkit",
                )
        return True, ""

    # -- the cache -----------------------------------------------------------------------------
    def _hashed_files(self) -> list[Path]:
        """Every source and header the build can read from this op's folders (sorted, deduped)."""
        files = set(self.source_paths())
        for d in self.include_paths():
            if d.is_dir():
                files.update(
                    p for p in d.rglob("*") if p.is_file() and p.suffix in _HASHED_SUFFIXES
                )
        return sorted(files)

    def _hashed_name(self, path: Path) -> str:
        """The name `path` enters the key under: relative to the shared headers or to `csrc_root`,
        so the same files in another checkout give the same key (Note [shared headers])."""
        if path.is_relative_to(SHARED_INCLUDE_DIR):
            return str(Path("<shared>") / path.relative_to(SHARED_INCLUDE_DIR))
        return str(path.relative_to(self.root) if path.is_relative_to(self.root) else path)

    def fingerprint(self) -> str:
        """16 hex digits naming this variant (see Note [op cache layout]).

        Source contents are read once per builder and flag set; later calls hash only the flags.
        """
        parts = [
            self.name,
            platform.machine(),
            f"py{sys.version_info.major}.{sys.version_info.minor}",
            torch.__version__,
            str(torch.version.cuda),
            str(toolchain.cxx_compiler()),
            *self.cxx_flags(),
            *self.ld_flags(),
        ]
        if self.requires_cuda:
            parts += [str(toolchain.find_nvcc()), *self.nvcc_flags()]
        key = tuple(parts)
        if key not in self._fingerprints:
            h = hashlib.sha256()
            for part in parts:
                h.update(part.encode() + b"\0")
            for name, path in sorted((self._hashed_name(p), p) for p in self._hashed_files()):
                h.update(name.encode() + b"\0")
                h.update(path.read_bytes() if path.is_file() else b"<missing>")
            self._fingerprints[key] = h.hexdigest()[:16]
        return self._fingerprints[key]

    def cache_dir(self) -> Path:
        """The directory this variant builds into (see Note [op cache layout])."""
        return op_cache_root() / f"{self.name}-{self.fingerprint()}"

    def module_name(self) -> str:
        """The Python module name of the built extension (unique per variant)."""
        return f"minispeed_{self.name}_{self.fingerprint()[:12]}"

    def is_cached(self) -> bool:
        """Whether a finished build of this exact variant is in the cache (loading needs no compiler)."""
        d = self.cache_dir()
        return (d / MARKER).is_file() and (d / f"{self.module_name()}{LIB_SUFFIX}").is_file()

    # -- loading -------------------------------------------------------------------------------
    @property
    def last_load(self) -> LoadRecord | None:
        """How this process loaded the variant `cache_dir` names, or `None` if not yet."""
        entry = _loaded.get(self.cache_dir())
        return entry[1] if entry else None

    def load(self, verbose: bool | None = None) -> ModuleType:
        """The compiled module: memoized in this process, else from the cache, else built now.

        Raises `OpBuildError` when the op is incompatible here or the build fails; the same
        error is raised again on later calls in this process without retrying the compiler.
        `verbose` (default: `MINISPEED_OP_VERBOSE=1`) streams the compiler's output.
        """
        if verbose is None:
            verbose = os.environ.get(VERBOSE_ENV, "0") not in ("", "0")
        with _process_lock:
            key = self.cache_dir()
            if key in _loaded:
                return _loaded[key][0]
            if key in _failed:
                raise _failed[key]
            try:
                module, record = self._load_uncached(key, verbose)
            except OpBuildError as err:
                _failed[key] = err
                raise
            _loaded[key] = (module, record)
            return module

    def _load_uncached(self, cache_dir: Path, verbose: bool) -> tuple[ModuleType, LoadRecord]:
        ok, why = self.is_compatible()
        if not ok:
            raise OpBuildError(self.name, f"cannot be built here: {why}")
        cache_dir.mkdir(parents=True, exist_ok=True)
        name = self.module_name()
        try:
            with file_lock(cache_dir / LOCK_FILE, self.name):
                return self._import_or_build(name, cache_dir, verbose)
        except TimeoutError as err:  # only file_lock raises it; _build wraps its own errors
            raise OpBuildError(self.name, str(err)) from None

    def _import_or_build(
        self, name: str, cache_dir: Path, verbose: bool
    ) -> tuple[ModuleType, LoadRecord]:
        """Under the lock: import a finished build, else build (see Note [one builder per machine])."""
        if self.is_cached():
            start = time.perf_counter()
            try:
                module = import_extension(name, cache_dir / f"{name}{LIB_SUFFIX}")
            except ImportError as err:
                # A cached binary that no longer imports (e.g. a changed system library):
                # drop the marker and build afresh below.
                _log.warning("cached op %r failed to import (%s); rebuilding", self.name, err)
                (cache_dir / MARKER).unlink()
            else:
                _log.debug("op %r loaded from %s", self.name, cache_dir)
                return module, LoadRecord(name, cache_dir, False, time.perf_counter() - start)
        return self._build(name, cache_dir, verbose)

    def _build(self, name: str, cache_dir: Path, verbose: bool) -> tuple[ModuleType, LoadRecord]:
        from torch.utils.cpp_extension import load as torch_jit_load

        _log.info("building op %r into %s (once; later loads use the cache)", self.name, cache_dir)
        _drop_stale_baton(cache_dir, self.name)
        start = time.perf_counter()
        try:
            with _ninja_on_path():
                module = torch_jit_load(
                    name=name,
                    sources=[str(p) for p in self.source_paths()],
                    extra_cflags=self.cxx_flags(),
                    extra_cuda_cflags=self.nvcc_flags() if self.requires_cuda else None,
                    extra_ldflags=self.ld_flags(),
                    extra_include_paths=[str(p) for p in self.include_paths()],
                    build_directory=str(cache_dir),
                    with_cuda=self.requires_cuda,
                    verbose=verbose,
                )
        except Exception as err:
            output = str(err)
            raise OpBuildError(
                self.name,
                f"build failed: {_first_error_line(output)}",
                f"cxx flags: {' '.join(self.cxx_flags())}\ncache dir: {cache_dir}\n{output[-6000:]}",
            ) from err
        seconds = time.perf_counter() - start
        write_json_atomic(
            cache_dir / MARKER,
            {
                "op": self.name,
                "module": name,
                "cxx_flags": self.cxx_flags(),
                "nvcc_flags": self.nvcc_flags() if self.requires_cuda else [],
                "torch": torch.__version__,
                "build_seconds": round(seconds, 2),
            },
        )
        _log.info("built op %r in %.1f s", self.name, seconds)
        return module, LoadRecord(name, cache_dir, True, seconds)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, root={str(self.root)!r})"


def _first_error_line(output: str) -> str:
    """The compiler's first `error` line (what a user needs first), else the first line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() and not line.startswith("Error building extension"):
            return line[:300]
    return lines[0][:300] if lines else "unknown error"


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """Put ninja's directory on PATH for torch's JIT, which calls plain `ninja`."""
    ninja = toolchain.find_ninja()
    old = os.environ.get("PATH", "")
    ninja_dir = str(Path(ninja).parent) if ninja else None
    if ninja_dir and ninja_dir not in old.split(os.pathsep):
        os.environ["PATH"] = ninja_dir + os.pathsep + old
        try:
            yield
        finally:
            os.environ["PATH"] = old
    else:
        yield


# Note [a build killed half-way]
# torch's `cpp_extension.load` guards a build directory with a baton: it creates a file named
# `lock` there, builds, and deletes it; a second process finding the file waits, polling, until
# it goes. A builder killed half-way (a rank killed at a test's timeout, Ctrl-C at the wrong
# moment) never deletes it, and every later build of that op then waits forever: a hang at the
# first call of the op, long after the cause. Our own lock is an `flock`, which the kernel
# drops with the process, and `_build` runs only while holding it, so no other minispeed
# process can be building here: a baton found now is stale, and is removed with a warning.


def _drop_stale_baton(cache_dir: Path, op: str) -> None:
    baton = cache_dir / "lock"
    if baton.exists():
        _log.warning(
            "op %r: removing %s, left by a build that was killed half-way (Note [a build killed "
            "half-way])",
            op,
            baton,
        )
        baton.unlink(missing_ok=True)
