"""The README's record of the stage-3 path stays true (issue 21: ≤ 6 files from `zero.shard` to
the `torch.distributed` call, recorded with their sizes).

`packages/zero/README.md`, section "The stage-3 path", lists each file a reader opens with its
line count and the total. These tests fail as soon as a listed file is moved, grows or shrinks
without the table following, and when the README's reading order of `stage3/` and the one in
`stage3/__init__.py`'s docstring disagree.
"""

from __future__ import annotations

import pathlib
import re

import minispeed.zero.stage3 as stage3

ROOT = pathlib.Path(__file__).resolve().parents[3]  # the monorepo: packages/zero/tests/ -> root
README = ROOT / "packages" / "zero" / "README.md"

_ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \| ([\d,]+) \|", re.M)
_TOTAL = re.compile(r"^\| \| total \| ([\d,]+) \|", re.M)


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _wc_l(path: pathlib.Path) -> int:
    """What `wc -l` prints: the number of newline characters."""
    return path.read_bytes().count(b"\n")


def test_stage3_path_lists_existing_files_with_their_wc_line_counts() -> None:
    rows = _ROW.findall(_section("The stage-3 path"))
    assert rows, "README: the stage-3 path table has no rows"
    assert [int(step) for step, _, _ in rows] == list(range(1, len(rows) + 1))
    for _, path, stated in rows:
        file = ROOT / path
        assert file.is_file(), f"README's stage-3 path lists {path}, which does not exist"
        assert int(stated.replace(",", "")) == _wc_l(file), (
            f"README's stage-3 path says {path} has {stated} lines, wc -l says {_wc_l(file)}: "
            f"update the table in packages/zero/README.md"
        )


def test_stage3_path_total_is_the_sum_and_within_six_files() -> None:
    section = _section("The stage-3 path")
    rows = _ROW.findall(section)
    (total,) = _TOTAL.findall(section)
    assert int(total.replace(",", "")) == sum(int(n.replace(",", "")) for _, _, n in rows)
    assert len(rows) <= 6, f"issue 21: at most 6 files on the stage-3 path, the table lists {rows}"


def test_readme_reading_order_of_stage3_matches_its_init_docstring() -> None:
    # The numbered items of stage3/__init__.py's docstring name modules in backticks; the README's
    # item 6 names the same files, in the same order.
    doc = stage3.__doc__ or ""
    items = re.findall(r"^\d+\. (.*?)(?=^\d+\. |^\s*$)", doc, re.M | re.S)
    modules = [m for item in items for m in re.findall(r"`([a-z_0-9]+)`", item)]
    modules = [
        m
        for m in modules
        if (ROOT / "packages/zero/src/minispeed/zero/stage3" / f"{m}.py").is_file()
    ]
    readme = _section("Reading order")
    item6 = readme[readme.index("6. Stage 3, `stage3/`") : readme.index("7. Checkpoints")]
    listed = [m for m in re.findall(r"`([a-z_0-9]+)\.py`", item6) if m != "__init__"]
    assert modules, "stage3/__init__.py's docstring lists no modules"
    assert listed == modules, (
        f"packages/zero/README.md's stage-3 reading order {listed} differs from "
        f"stage3/__init__.py's {modules}: update both"
    )
