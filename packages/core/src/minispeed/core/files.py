"""Files that are whole or absent: what a user saved is never lost or half-written.

`atomic_write(path, data)` writes to a temporary name in the same folder, flushes and fsyncs it,
renames it over `path` (one atomic step on POSIX file systems) and fsyncs the folder, so that the
rename itself survives a crash. A kill -9 or a power loss at any moment leaves either the old
file or the new one. The temporary name is unique per call (`mkstemp`), so two processes writing
the same path do not collide, and it is removed when the write fails.

```python
atomic_write("metrics.json", json.dumps(metrics))          # str: UTF-8
atomic_write("model.pt", lambda f: torch.save(state, f))   # or a writer of a binary file
atomic_write_json("trials.json", rows)
```

Cost: the bytes once, two fsyncs (file and folder) and a rename.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["atomic_write", "atomic_write_json", "fsync_dir", "make_parent"]


def fsync_dir(folder: str | os.PathLike) -> None:
    """fsync a folder, so that a rename or a new entry in it is on disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_parent(path: str | os.PathLike) -> Path:
    """Create the folder `path` goes in, with its missing parents (as `mkdir -p`): what a command
    does with its output path (`--out`, `OUT.pt`). Returns `path`; a folder that cannot be made
    (a parent is a file, no permission) is an `OSError` naming it and why."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in (path.parent, *path.parent.parents) if p.exists()), None)
        why = f"{blocker} is a file" if blocker and not blocker.is_dir() else e.strerror or e
        raise OSError(
            e.errno, f"cannot create the folder {path.parent} for {path}: {why}"
        ) from None
    return path


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], Any]) -> int:
    """Replace `path` by `data` (bytes, text written as UTF-8, or a function writing to a binary
    file object) atomically; returns the bytes written. The folder must exist."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> None:
    """`atomic_write` of `obj` as JSON."""
    atomic_write(path, json.dumps(obj, indent=indent))
