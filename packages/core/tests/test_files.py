"""`atomic_write`: a file is replaced whole or left as it was, and no temporary file remains."""

import json

import pytest

from minispeed.core.files import atomic_write, atomic_write_json


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
