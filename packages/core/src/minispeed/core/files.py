"""Files that are whole or absent: what a user saved is never lost or half-written.

`atomic_replace(path)` gives a temporary name in the same folder to write to; when the block
ends it fsyncs that file, renames it over `path` (one atomic step on POSIX file systems) and
fsyncs the folder, so that the rename itself survives a crash. A kill -9 or a power loss at any
moment leaves either the old file or the new one. The temporary name is unique per call (random,
created exclusively), so two processes writing the same path do not collide, and it is removed
when the block raises (a writer failing half-way, a full disk): nothing is left behind.
`atomic_write` is the same for bytes, text or a function writing to a binary file object.

```python
atomic_write("metrics.json", json.dumps(metrics))          # str: UTF-8
atomic_write("model.pt", lambda f: torch.save(state, f))   # or a writer of a binary file
atomic_write_json("trials.json", rows)
with atomic_replace("trace.json") as tmp:                  # a writer that wants a path
    prof.export_chrome_trace(str(tmp))
```

Every file minispeed saves for a later process (checkpoints, build records, profiles, tuner
trials) goes through `atomic_replace`. Cost: the bytes once, two fsyncs (file and folder) and a
rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["atomic_replace", "atomic_write", "atomic_write_json", "fsync_dir", "make_parent"]


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


def _fresh_temporary(path: Path) -> Path:
    """Create an empty, unused ``.<name>.<random>.tmp`` beside `path`, with the permissions a
    plain ``open(path, "w")`` would give (0o666 less the umask; `mkstemp`'s are 0o600)."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


@contextlib.contextmanager
def atomic_replace(path: str | os.PathLike) -> Iterator[Path]:
    """A fresh temporary path beside `path` to write; on a clean exit it is fsynced and renamed
    over `path` (then the folder is fsynced), on an exception it is removed and `path` is left as
    it was. The folder must exist."""
    path = Path(path)
    tmp = _fresh_temporary(path)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str | Callable[[BinaryIO], Any]) -> int:
    """Replace `path` by `data` (bytes, text written as UTF-8, or a function writing to a binary
    file object) atomically (`atomic_replace`); returns the bytes written."""
    with atomic_replace(path) as tmp, open(tmp, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        return f.tell()


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 1) -> None:
    """`atomic_write` of `obj` as JSON."""
    atomic_write(path, json.dumps(obj, indent=indent))
