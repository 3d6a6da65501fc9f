"""`atomic_write` / `atomic_replace`: a file is replaced whole or left as it was, and no temporary
file remains."""

import errno
import json
import os
import stat

import pytest

from minispeed.core.files import atomic_replace, atomic_write, atomic_write_json


def test_atomic_write_replaces_text_bytes_and_writer_output(tmp_path) -> None:
    path = tmp_path / "f.bin"
    assert atomic_write(path, "héllo") == len("héllo".encode())
    assert path.read_text() == "héllo"
    atomic_write(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    atomic_write(path, lambda f: f.write(b"abc"))
    assert path.read_bytes() == b"abc"
    atomic_write_json(tmp_path / "j.json", {"a": [1, 2]})
    assert json.loads((tmp_path / "j.json").read_text()) == {"a": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin", "j.json"]


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    path = tmp_path / "state.json"
    atomic_write_json(path, {"step": 1})

    def half_then_fail(f) -> None:
        f.write(b'{"step": 2, "wei')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert json.loads(path.read_text()) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_full_disk_inside_atomic_replace_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    path = tmp_path / "trace.json"
    path.write_text("old")
    with pytest.raises(OSError, match="No space left"), atomic_replace(path) as tmp:
        tmp.write_text("half of the new")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]
    with atomic_replace(path) as tmp:  # a writer that wants a path
        tmp.write_text("new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


def test_new_files_get_the_permissions_of_a_plain_open(tmp_path) -> None:
    umask = os.umask(0o022)
    try:
        atomic_write(tmp_path / "a", b"x")
        with open(tmp_path / "b", "wb") as f:
            f.write(b"x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o644
    assert (tmp_path / "a").stat().st_mode == (tmp_path / "b").stat().st_mode
