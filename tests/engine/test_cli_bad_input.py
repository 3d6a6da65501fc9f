"""The `minispeed` command's bad input (issue 32 §7): exit code 2 and a message naming the flag or
path, never a traceback (the command runs in this process, so an exception would fail the test)
and never a figure computed from nonsense. A missing output folder is created, as `mkdir -p`;
one that cannot be (a parent is a file) is exit code 2 naming it."""

from __future__ import annotations

import json

import pytest

from minispeed.engine.cli import main


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--params", "inf"], "--params must be a finite whole number >= 0, got inf"),
        (["--params", "nan"], "--params must be a finite whole number >= 0, got nan"),
        (["--params", "1e9", "--buffer-factor", "-1"], "--buffer-factor scales the CPU bytes up"),
        (["--params", "1e9", "--buffer-factor", "nan"], "must be a finite number >= 1, got nan"),
        (["--params", "1e9", "--largest-layer", "nan"], "--largest-layer must be a finite"),
        (["--params", "1e9", "--gpu-mem", "inf"], "--gpu-mem must be a finite number > 0 GiB"),
    ],
)
def test_estimate_refuses_numbers_that_are_no_sizes(argv, words, capsys) -> None:
    assert main(["estimate", *argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert words in captured.err and not captured.out, captured


def test_estimate_still_answers_good_input(capsys) -> None:
    assert main(["estimate", "--params", "1e9", "--buffer-factor", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(r["cpu_bytes_per_node"] >= 0 for r in rows)


def test_config_schema_out_creates_its_folder_or_names_the_file_in_the_way(tmp_path, capsys):
    out = tmp_path / "missing" / "dir" / "s.json"
    assert main(["config", "schema", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["type"] == "object"
    (tmp_path / "a_file").write_text("")
    assert main(["config", "schema", "--out", str(tmp_path / "a_file" / "s.json")]) == 2
    assert f"{tmp_path / 'a_file'} is a file" in capsys.readouterr().err


def test_consolidate_into_a_folder_that_cannot_be_made_names_it(tmp_path, capsys) -> None:
    (tmp_path / "a_file").write_text("")
    assert main(["consolidate", str(tmp_path), str(tmp_path / "a_file" / "o.pt")]) == 2
    out = capsys.readouterr().out.replace("\n", "")
    assert f"{tmp_path / 'a_file'} is a file" in out and "Traceback" not in out
