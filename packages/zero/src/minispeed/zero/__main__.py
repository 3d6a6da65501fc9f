"""Command line: `python -m minispeed.zero {consolidate,estimate} ...`.

```bash
python -m minispeed.zero consolidate CKPT_DIR OUT.pt [--tag TAG]
python -m minispeed.zero estimate --params 175e9 --world-size 1024 --gpu-memory-gib 80
```
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console


def _consolidate(args: argparse.Namespace, console: Console) -> int:
    from minispeed.core.files import make_parent
    from minispeed.zero.checkpoints import CheckpointError, consolidate

    try:
        make_parent(args.out_file)
    except OSError as e:
        console.print(f"[red]error:[/] {e.strerror or e}")
        return 2
    try:
        report = consolidate(args.checkpoint_dir, args.out_file, tag=args.tag)
    except CheckpointError as e:
        console.print(f"[red]error:[/] {e}")
        return 1
    console.print(
        f"wrote {report.out_file}: {report.num_params:,} fp32 parameters, "
        f"{report.total_bytes:,} bytes; held at most {report.peak_held_bytes:,} bytes "
        f"(bound: largest parameter + one shard = {report.bound_bytes:,})"
    )
    return 0


def _estimate(args: argparse.Namespace, console: Console) -> int:
    from minispeed.zero.memory import estimate

    est = estimate(
        args.params,
        args.world_size,
        gpu_memory_gib=args.gpu_memory_gib,
        param_bytes=args.param_bytes,
        grad_bytes=args.grad_bytes,
        optimizer_bytes=args.optimizer_bytes,
    )
    console.print(est)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the sub-command; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m minispeed.zero", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser(
        "consolidate", help="sharded checkpoint -> one fp32 state_dict file (streaming)"
    )
    c.add_argument("checkpoint_dir", help="directory given to save_checkpoint (or a tag directory)")
    c.add_argument(
        "out_file",
        help="output .pt file (torch.load gives the model's state_dict); its folder is created",
    )
    c.add_argument("--tag", default=None, help="tag to consolidate (default: the one in 'latest')")

    e = sub.add_parser("estimate", help="per-GPU model-state bytes of each ZeRO stage")
    e.add_argument("--params", type=float, required=True, help="parameter count, e.g. 175e9")
    e.add_argument("--world-size", type=int, required=True, help="data-parallel GPUs N")
    e.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of one GPU")
    e.add_argument("--param-bytes", type=int, default=2, help="p: 2 for 16-bit, 4 for fp32")
    e.add_argument("--grad-bytes", type=int, default=2, help="g: bytes per gradient element")
    e.add_argument("--optimizer-bytes", type=int, default=12, help="K: 12 for mixed-precision Adam")

    args = parser.parse_args(argv)
    console = Console()
    return {"consolidate": _consolidate, "estimate": _estimate}[args.command](args, console)


if __name__ == "__main__":
    sys.exit(main())
