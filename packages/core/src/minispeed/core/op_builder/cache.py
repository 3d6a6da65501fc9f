"""Where built ops live on disk, and how processes share them safely.

See Note [op cache layout] and Note [one builder per machine] below; `OpBuilder` in
`.builder` is the only caller.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from minispeed.core.files import atomic_write_json
from minispeed.core.logging import get_logger

__all__ = [
    "CACHE_ENV",
    "LIB_SUFFIX",
    "LOCK_FILE",
    "LOCK_TIMEOUT_ENV",
    "MARKER",
    "file_lock",
    "import_extension",
    "op_cache_root",
    "write_json_atomic",
]

CACHE_ENV = "MINISPEED_OP_CACHE"
LOCK_TIMEOUT_ENV = "MINISPEED_OP_LOCK_TIMEOUT"
MARKER = "minispeed_build.json"  # written last: its presence means the .so beside it is complete
LOCK_FILE = ".minispeed.lock"
LIB_SUFFIX = ".pyd" if sys.platform == "win32" else ".so"

_log = get_logger("op_builder")

# Note [op cache layout]
# <root>/<torch version>/<op>-<16 hex of sha256>/ holds one variant of one op: ninja's files, the
# `.so`, and `minispeed_build.json`, written (temp file, fsync, rename) only after a successful
# build. The hash covers every source/header in the op's folders and core's shared headers
# (Note [shared headers] in `.builder`), all compiler flags (so the
# SIMD level and CUDA archs), the compiler path, Python and torch versions: change any of them
# and the op lands in a new folder instead of loading a stale binary. <root> is
# $MINISPEED_OP_CACHE, else $XDG_CACHE_HOME/minispeed/ops, else ~/.cache/minispeed/ops.

# Note [one builder per machine]
# Ranks of one job start together and all call load(). Each takes an exclusive flock on
# <cache dir>/.minispeed.lock; the first builds while the others block; when they get the lock
# the marker exists and they import the finished `.so`. flock is released by the kernel if the
# builder dies, so a crash never leaves a stale lock. Waiting longer than
# $MINISPEED_OP_LOCK_TIMEOUT seconds (default 1800) raises instead of hanging. The cache should be
# on a local disk: flock over some network filesystems does not exclude other nodes.


def op_cache_root() -> Path:
    """The directory under which every op variant is cached, per torch version (Note [op cache layout])."""
    root = os.environ.get(CACHE_ENV)
    if root:
        base = Path(root).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "minispeed" / "ops"
    return base / torch.__version__


def import_extension(module_name: str, path: Path) -> ModuleType:
    """Import the extension at `path` without touching `sys.path` (as torch's JIT does)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot create an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def file_lock(path: Path, op: str) -> Iterator[None]:
    """Exclusive `flock` on `path` (see Note [one builder per machine]).

    Raises `TimeoutError` after `$MINISPEED_OP_LOCK_TIMEOUT` seconds of waiting.
    """
    timeout_s = float(os.environ.get(LOCK_TIMEOUT_ENV, "1800"))
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log.info("op %r: another process is building it; waiting for %s", op, path)
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"op {op!r}: waited {timeout_s:.0f} s for the build lock {path}: another process "
                            f"is still building; raise {LOCK_TIMEOUT_ENV} or kill the stuck build",
                        ) from None
                    time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json_atomic(path: Path, payload: dict) -> None:
    """Write `payload` to `path` whole or not at all (`minispeed.core.files`)."""
    atomic_write_json(path, payload, indent=2)
