"""The README's "The stage-3 path" is measured, not chosen: one default stage-3 step, traced.

On 2 gloo ranks, `zero.shard(model, AdamW, ZeroConfig(stage=3))` (every default: fp32, overlap,
the persistence threshold, the trace check) over four `Linear(320, 320)` layers, whose weights
(102,400 elements) are above the persistence threshold, so they are gathered and released every
step while the biases persist. Then the first step (forward, backward, `step`) runs under
`sys.setprofile`. At every call into one of torch.distributed's collectives the files of our
frames on the stack, between the step's entry and that call, are recorded: **the path**. Every
other file of ours that the step runs (checks, bookkeeping, guards, called and returned before
a collective) is **beside the path**. `zero.shard` itself is traced the same way: the files on
the stack at its collectives (the broadcasts of partitioning, the persistent parameters' gather)
are **the set-up**. `packages/zero/README.md` lists the three sets in three tables, each file
with its code lines counted by `ast` (docstrings, comments and blank lines excluded), and a
total. These tests fail when a table and the trace disagree (a file moved, added, removed, grown
or shrunk), and when the path grows past issue 31's bound of 2,000 code lines.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import sys
import threading
import tokenize
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import minispeed.comm.api_compat as api_compat
import minispeed.zero as zero
import minispeed.zero.stage3 as stage3
from minispeed.core.testing import run_distributed

ROOT = pathlib.Path(__file__).resolve().parents[3]  # the monorepo: packages/zero/tests/ -> root
README = ROOT / "packages" / "zero" / "README.md"
PATH_BOUND = 2_000  # issue 31: code lines on the traced path

# torch.distributed's collectives (distributed_c10d.py): what puts bytes on the wire.
COLLECTIVES = frozenset(
    [
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_coalesced",
        "all_reduce_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "reduce",
        "gather",
        "scatter",
        "all_to_all",
        "all_to_all_single",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "barrier",
        "monitored_barrier",
        "all_gather_object",
        "broadcast_object_list",
        "gather_object",
        "scatter_object_list",
    ]
)


def code_lines(path: pathlib.Path) -> int:
    """Lines holding code: a token other than a comment, with docstrings (every string
    statement) and blank lines excluded."""
    source = path.read_text()
    docs = set()
    for node in ast.walk(ast.parse(source)):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            docs.update(range(node.lineno, node.end_lineno + 1))
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    layout |= {tokenize.ENCODING, tokenize.ENDMARKER}
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in layout:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docs)


def _ours(filename: str) -> str | None:
    """The repository path of one of our packages' source files (not a test), else None.

    Editable installs run the files under `packages/<name>/src/`; a plain install (the
    install-alone check) runs copies under `site-packages/minispeed/<name>/`, which map back
    to the same repository path."""
    parts = pathlib.Path(filename).resolve().parts
    if "minispeed" not in parts:
        return None
    at = len(parts) - 1 - parts[::-1].index("minispeed")
    if at + 2 >= len(parts) or "tests" in parts[at:]:
        return None
    package = parts[at + 1]
    path = ROOT / "packages" / package / "src" / pathlib.Path(*parts[at:])
    return str(path.relative_to(ROOT)) if path.is_file() else None


def _traced_step(rank: int, world_size: int) -> tuple[list[str], list[str], list[str]]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(320, 320), nn.Tanh()) for _ in range(4)))
    x = torch.randn(4, 320, generator=torch.Generator().manual_seed(rank))
    top = sys._getframe()
    set_up: dict[str, None] = {}
    on_path: dict[str, None] = {}
    executed: dict[str, None] = {}

    def profile(frame, event: str, arg) -> None:
        if event != "call":
            return
        name = frame.f_code.co_filename
        if name.endswith("distributed_c10d.py") and frame.f_code.co_name in COLLECTIVES:
            f = frame
            while f is not None and f is not top:
                mine = _ours(f.f_code.co_filename)
                if mine:
                    on_path[mine] = None
                f = f.f_back
        elif "minispeed" in name:
            mine = _ours(name)
            if mine:
                executed[mine] = None

    def traced(run) -> Any:
        sys.setprofile(profile)
        threading.setprofile(profile)
        try:
            return run()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    config = zero.ZeroConfig(stage=3)
    opt = traced(lambda: zero.shard(model, torch.optim.AdamW(model.parameters()), config=config))
    set_up.update(on_path)
    on_path.clear()
    executed.clear()
    # The tables follow a reduce-scatter as a backend's own (here gloo's all-reduce form); the
    # second step's trace, with gloo's default ring, gives the files the ring adds.
    with api_compat.reduce_scatter_as("all_reduce"):
        traced(lambda: (opt.backward(model(x).pow(2).mean()), opt.step()))
    path, beside = list(on_path), [f for f in executed if f not in on_path]
    on_path.clear()
    traced(lambda: (opt.backward(model(x).pow(2).mean()), opt.step()))
    assert dist.is_initialized()
    return path, beside, list(set_up), list(on_path)


@pytest.fixture(scope="module")
def traced() -> tuple[set[str], set[str], set[str], set[str]]:
    ranks = run_distributed(_traced_step, world_size=2, timeout_s=120)
    path = {f for r in ranks for f in r[0]}
    beside = {f for r in ranks for f in r[1]} - path
    ring = {f for r in ranks for f in r[3]} - path
    return path, beside, {f for r in ranks for f in r[2]}, ring


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _table(heading: str) -> tuple[dict[str, int], int]:
    """{file: stated code lines} and the stated total of the table under `heading`."""
    section = _section("The stage-3 path")
    start = section.index(heading)
    end = section.find("\n### ", start + 1)
    table = section[start : end if end >= 0 else len(section)]
    rows = re.findall(r"^\|(?: \d+ \|)? `([^`]+)` \| ([\d,]+) \|", table, re.M)
    (total,) = re.findall(r"^\|(?: \|)? total \| ([\d,]+) \|", table, re.M)
    return {f: int(n.replace(",", "")) for f, n in rows}, int(total.replace(",", ""))


def _check(table: dict[str, int], total: int, traced_files: set[str], what: str) -> None:
    assert set(table) == traced_files, (
        f"packages/zero/README.md, {what}: the trace has {sorted(traced_files - set(table))} "
        f"that the table lacks, the table has {sorted(set(table) - traced_files)} that the "
        f"trace lacks"
    )
    counted = {f: code_lines(ROOT / f) for f in traced_files}
    assert table == counted, (
        f"packages/zero/README.md, {what}: code lines stated {table}, counted {counted}"
    )
    assert total == sum(counted.values()), f"{what}: the total is {sum(counted.values())}"


def test_the_path_table_is_the_traced_path_with_its_code_lines(traced) -> None:
    path, _, _, _ = traced
    table, total = _table("### The path")
    _check(table, total, path, "the path")
    assert total <= PATH_BOUND, f"issue 31: at most {PATH_BOUND} code lines on the path, {total}"


def test_the_beside_table_is_every_other_file_the_step_runs(traced) -> None:
    _, beside, _, _ = traced
    table, total = _table("### Beside the path")
    _check(table, total, beside, "beside the path")


def test_the_set_up_table_is_zero_shards_own_path(traced) -> None:
    _, _, set_up, _ = traced
    table, total = _table("### The set-up")
    _check(table, total, set_up, "the set-up")


def test_the_ring_table_is_what_gloos_ring_adds_to_the_path(traced) -> None:
    _, _, _, ring = traced
    table, total = _table("### On gloo, the ring")
    _check(table, total, ring, "on gloo, the ring")


def test_code_lines_leave_out_docstrings_comments_and_blank_lines(tmp_path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        '"""Doc\n\nstring."""\n\n# a comment\nx = (1,\n     2)  # trailing\n\n\ndef g():\n'
        '    """Doc."""\n    return """not a\n    docstring"""\n'
    )
    assert code_lines(f) == 5  # x = (1, / 2) / def g(): / return """not a / docstring"""


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
