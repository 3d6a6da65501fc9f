"""Loading a grid checkpoint (`grid.py`'s layout) into this rank's part.

Find the tag (`latest` or `tag=`), read `grid.json` and refuse a grid that cannot load
(`check_grid`), then hand the part to `zero.load_checkpoint`, or to `resplit.py` when the
tensor-parallel size changed, or to `deepspeed_files.py` when DeepSpeed itself wrote the tag. Every step is
agreed over the world (Note [a checkpoint fails on every rank]). Apart from `grid.py`
because the re-split builds on the layout that module defines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import minispeed.zero as zero
from minispeed.engine.checkpoint.deepspeed_files import is_deepspeed_tag, load_deepspeed
from minispeed.engine.checkpoint.grid import (
    Part,
    check_grid,
    find_tag,
    part_dir,
    read_grid,
)
from minispeed.engine.checkpoint.resplit import load_resplit
from minispeed.zero.checkpoints import together

__all__ = ["load_part"]


def load_part(
    part: Part,
    load_dir: str | os.PathLike,
    tag: str | None,
    *,
    load_optimizer_states: bool,
    strict: bool = True,
    universal: bool = False,
) -> tuple[Path, dict[str, Any] | None]:
    """Load this rank's part (collective over the world); returns (tag dir, saved payload).
    `strict=False`: frozen parameters may differ (zero's `load_checkpoint`). `universal`
    (`checkpoint.load_universal`): with no tag, `latest_universal` names it (`grid.latest_file`)."""
    what = f"load_checkpoint from {os.fspath(load_dir)!r}" + (f" (tag {tag!r})" if tag else "")

    def find() -> tuple[Path, int | None]:
        tag_dir = find_tag(load_dir, tag, universal)
        if is_deepspeed_tag(tag_dir):  # DeepSpeed's own files, universal too (deepspeed_files.py)
            return tag_dir, None
        saved = read_grid(tag_dir)
        check_grid(saved, part, tag_dir)
        return tag_dir, 1 if saved is None else saved["grid"].get("tensor", 1)

    (tag_dir, saved_tensor), _ = together(None, what, find)
    if saved_tensor is None:
        payload = load_deepspeed(
            part, tag_dir, load_optimizer_states=load_optimizer_states, strict=strict, what=what
        )
        return tag_dir, payload
    where = part_dir(tag_dir, part.place)
    if saved_tensor != part.place.tensor:
        # See resplit.py: this rank's slices, re-cut from the saved ones.
        payload = load_resplit(
            part, tag_dir, saved_tensor, load_optimizer_states=load_optimizer_states, what=what,
            strict=strict,
        )  # fmt: skip
        return tag_dir, payload
    payload = zero.load_checkpoint(
        part.optimizer,
        part.module,
        where.parent,
        where.name,
        load_optimizer_states=load_optimizer_states,
        strict=strict,
    )
    return tag_dir, payload
