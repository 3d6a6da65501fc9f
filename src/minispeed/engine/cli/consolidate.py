"""`minispeed consolidate CKPT_DIR OUT.pt [--tag TAG]`: `python -m minispeed.zero consolidate`,
which also reads a checkpoint DeepSpeed itself wrote; `minispeed consolidate CKPT_DIR OUT_DIR
--to deepspeed-universal [--tag TAG]`: the tag as a DeepSpeed universal checkpoint folder.

The zero package knows its own layout only; when the tag (`--tag`, else the one `latest` names,
else CKPT_DIR itself) holds DeepSpeed's files, its weights are first joined per parameter into a
temporary one-rank minispeed checkpoint (`minispeed.engine.checkpoint.deepspeed_files`), which
the zero command then consolidates. Every other argument (`--help` too) goes to it unchanged.

`--to deepspeed-universal` writes the whole training state (fp32 masters, optimizer states,
step, scheduler, counters, client state) as the folder DeepSpeed 0.19.8's
`ds_to_universal` would write, OUT_DIR, with `latest_universal` beside it naming it; DeepSpeed
resumes from OUT_DIR's parent with `"checkpoint": {"load_universal": true}` at any
data-parallel size and ZeRO stage 1-3 (`minispeed.engine.checkpoint.universal`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from minispeed.engine.checkpoint.grid import find_tag
from minispeed.zero.checkpoints import LATEST_FILE

__all__ = ["main"]


_MORE_HELP = """
also:
  checkpoint_dir may hold a checkpoint DeepSpeed wrote (its global_step* tags); its weights are
  consolidated the same way.
  --to deepspeed-universal  write the whole training state instead, as a DeepSpeed universal
                            checkpoint folder named by out_file (latest_universal beside it);
                            DeepSpeed resumes it with "checkpoint": {"load_universal": true}"""


def _tag_dir(checkpoint_dir: str, tag: str | None) -> Path:
    """`--tag`, else the tag `latest` names, else CKPT_DIR itself (the zero command's rule)."""
    root = Path(checkpoint_dir)
    return find_tag(root, tag) if tag is not None or (root / LATEST_FILE).is_file() else root


def main(argv: Sequence[str]) -> int:
    """Run `minispeed.zero`'s command line on `argv` (`["consolidate", ...]`), a DeepSpeed tag
    converted first (`deepspeed_files.weights_tag_dir`, the conversion the adapter
    `zero_to_fp32` uses too); returns the exit status."""
    from minispeed.engine.checkpoint.deepspeed_files import is_deepspeed_tag, weights_tag_dir
    from minispeed.zero.__main__ import main as zero_main
    from minispeed.zero.checkpoints import CheckpointError

    args = list(argv)
    if any(a in ("-h", "--help") for a in args):
        try:
            status = zero_main(args)  # its usage
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 0
        print(_MORE_HELP)
        return status
    if len(args) < 3:
        return zero_main(args)  # its error
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("command")
    p.add_argument("checkpoint_dir")
    p.add_argument("out_file")
    p.add_argument("--tag", default=None)
    p.add_argument("--to", default=None)
    known, rest = p.parse_known_args(args)
    if known.to is not None:
        return _to_universal(known, rest)
    if rest or known.command != "consolidate":  # --help, or arguments for zero to judge
        return zero_main(args)
    tag_dir = _tag_dir(known.checkpoint_dir, known.tag)
    if not is_deepspeed_tag(tag_dir):
        return zero_main(args)
    try:
        with weights_tag_dir(tag_dir) as converted:
            return zero_main(["consolidate", str(converted), known.out_file])
    except CheckpointError as e:
        print(f"error: {e}")
        return 1


def _to_universal(known: argparse.Namespace, rest: list[str]) -> int:
    """`--to deepspeed-universal`: exit status 2 for bad arguments, 1 for a checkpoint that
    cannot convert (the reason and the fix printed), 0 once OUT_DIR is complete."""
    from minispeed.engine.checkpoint.deepspeed_files import is_deepspeed_tag
    from minispeed.engine.checkpoint.universal import write_universal
    from minispeed.zero.checkpoints import CheckpointError

    if known.to != "deepspeed-universal" or rest or known.command != "consolidate":
        print(
            f"error: --to {known.to!r}{' with ' + ' '.join(rest) if rest else ''}: the one "
            "conversion is 'minispeed consolidate CKPT_DIR OUT_DIR --to deepspeed-universal "
            "[--tag TAG]'"
        )
        return 2
    tag_dir = _tag_dir(known.checkpoint_dir, known.tag)
    if is_deepspeed_tag(tag_dir):
        print(
            f"error: {tag_dir} holds DeepSpeed's own files: convert it with DeepSpeed's "
            "'python -m deepspeed.checkpoint.ds_to_universal' (minispeed loads it as it is)"
        )
        return 1
    try:
        out = write_universal(tag_dir, Path(known.out_file))
    except (CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}")
        return 1
    print(
        f"wrote DeepSpeed universal checkpoint {out} ({out.parent}/latest_universal names it); "
        'resume with "checkpoint": {"load_universal": true} and load_checkpoint('
        f"{str(out.parent)!r})"
    )
    return 0
