"""`minispeed consolidate CKPT_DIR OUT.pt [--tag TAG]`: `python -m minispeed.zero consolidate`,
which also reads a checkpoint DeepSpeed itself wrote.

The zero package knows its own layout only; when the tag (`--tag`, else the one `latest` names,
else CKPT_DIR itself) holds DeepSpeed's files, its weights are first joined per parameter into a
temporary one-rank minispeed checkpoint (`minispeed.engine.checkpoint.deepspeed_files`), which
the zero command then consolidates. Every other argument (`--help` too) goes to it unchanged.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence
from pathlib import Path

from minispeed.engine.checkpoint.grid import find_tag
from minispeed.zero.checkpoints import LATEST_FILE

__all__ = ["main"]


def _tag_dir(checkpoint_dir: str, tag: str | None) -> Path:
    """`--tag`, else the tag `latest` names, else CKPT_DIR itself (the zero command's rule)."""
    root = Path(checkpoint_dir)
    return find_tag(root, tag) if tag is not None or (root / LATEST_FILE).is_file() else root


def main(argv: Sequence[str]) -> int:
    """Run `minispeed.zero`'s command line on `argv` (`["consolidate", ...]`), a DeepSpeed tag
    converted first; returns the exit status. The conversion repeats the adapter
    `deepspeed.utils.zero_to_fp32`'s `zero_tag_dir` because the engine's core may not import an
    adapter (tests/engine/test_import_graph.py)."""
    from minispeed.engine.checkpoint.deepspeed_files import deepspeed_weights, is_deepspeed_tag
    from minispeed.zero.__main__ import main as zero_main
    from minispeed.zero.checkpoints import CheckpointError

    args = list(argv)
    if len(args) < 3 or any(a in ("-h", "--help") for a in args):
        return zero_main(args)  # its usage, or its error
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("command")
    p.add_argument("checkpoint_dir")
    p.add_argument("out_file")
    p.add_argument("--tag", default=None)
    known, rest = p.parse_known_args(args)
    if rest or known.command != "consolidate":  # --help, or arguments for zero to judge
        return zero_main(args)
    tag_dir = _tag_dir(known.checkpoint_dir, known.tag)
    if not is_deepspeed_tag(tag_dir):
        return zero_main(args)
    try:
        work = deepspeed_weights(tag_dir)
    except CheckpointError as e:
        print(f"error: {e}")
        return 1
    try:
        return zero_main(["consolidate", str(work / "deepspeed"), known.out_file])
    finally:
        shutil.rmtree(work, ignore_errors=True)
