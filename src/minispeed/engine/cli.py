"""The `minispeed` command: one entry point for launching, checking and inspecting.

```bash
minispeed run --nproc_per_node 2 train.py --deepspeed_config ds.json   # see engine.launcher
minispeed report [--config ds.json]      # environment and ops; the config the engine resolves
minispeed config schema|reference        # the ds_config's JSON Schema, or its reference page
minispeed consolidate CKPT_DIR OUT.pt    # a sharded checkpoint -> one fp32 state_dict
minispeed estimate --params 7e9 --gpus 8 --nodes 1 --gpu-mem 80 --cpu-mem 512
minispeed trace ...                      # the profiler's Chrome trace of a step
```

Each subcommand is the package's own entry point (`minispeed.core.report`, `minispeed.zero`'s
`consolidate`/`estimate`, `minispeed.profiler`'s `trace`) behind one name; exit codes are 0 on
success, 2 on bad input (with the reason on stderr), and a failed rank's own code for `run`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from minispeed.engine import sizing

__all__ = ["main"]


def _run(args: argparse.Namespace) -> int:
    from minispeed.engine.launcher import LaunchArgs, run

    if not args.script:
        raise SystemExit("minispeed run: give the training script to launch")
    script, *rest = args.script
    return run(
        LaunchArgs(
            script=script,
            script_args=rest,
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            hostfile=args.hostfile,
            include=args.include,
            exclude=args.exclude,
            module=args.module,
        )
    )


def _report(args: argparse.Namespace) -> int:
    from minispeed.core.report import main as report_main

    code = report_main([])
    if args.config is None:
        return code
    from minispeed.engine.config import EngineConfig

    cfg = EngineConfig.load(args.config, data_parallel_size=args.world_size)
    given = cfg.raw
    rows = [
        ("train_batch_size", cfg.train_batch_size),
        ("train_micro_batch_size_per_gpu", cfg.micro_batch_size),
        ("gradient_accumulation_steps", cfg.gradient_accumulation_steps),
    ]
    print(f"\nresolved config ({args.config}, data-parallel size {args.world_size}):")
    for key, value in rows:
        source = "given" if given.get(key) not in (None, "auto") else "derived"
        print(f"  {key:34} {value!s:>12}  ({source})")
    print(f"  {'zero_optimization.stage':34} {cfg.zero.stage!s:>12}")
    print(f"  {'gradient_clipping':34} {cfg.zero.max_grad_norm!s:>12}  "
          f"({'given' if 'gradient_clipping' in given else 'default'})")  # fmt: skip
    print(f"  {'precision':34} {str(cfg.precision.param_dtype).removeprefix('torch.'):>12}")
    return code


def _config(args: argparse.Namespace) -> int:
    from minispeed.engine.config.__main__ import main as config_main

    return config_main([args.what, *(["--out", args.out] if args.out else [])])


def _delegate(module: str, prefix: Sequence[str]):
    def call(args: argparse.Namespace) -> int:
        import importlib

        main = importlib.import_module(module).main
        code = main([*prefix, *args.rest])
        return 0 if code is None else int(code)

    return call


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minispeed", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="launch a script on every rank (over torch.distributed.run)")
    r.add_argument("--nproc_per_node", "--num_gpus", dest="nproc_per_node", type=int)
    r.add_argument("--nnodes", "--num_nodes", dest="nnodes", type=int)
    r.add_argument("--node_rank", type=int)
    r.add_argument("--master_addr")
    r.add_argument("--master_port", type=int)
    r.add_argument("--hostfile", help="DeepSpeed hostfile: 'host slots=N' per line")
    r.add_argument("--include", help="hosts to use, host1@host2 (with --hostfile)")
    r.add_argument("--exclude", help="hosts to leave out, host1@host2 (with --hostfile)")
    r.add_argument("--module", action="store_true", help="the script is a module (python -m)")
    r.add_argument("script", nargs=argparse.REMAINDER, help="script and its arguments")
    r.set_defaults(fn=_run)

    rep = sub.add_parser("report", help="environment, ops, and the config the engine resolves")
    rep.add_argument("--config", help="a ds_config.json to resolve")
    rep.add_argument("--world-size", type=int, default=1, help="data-parallel size to resolve at")
    rep.set_defaults(fn=_report)

    c = sub.add_parser("config", help="the ds_config JSON Schema, or the reference page")
    c.add_argument("what", choices=("schema", "reference"))
    c.add_argument("--out", help="write to this file (atomically)")
    c.set_defaults(fn=_config)

    e = sub.add_parser(
        "estimate",
        help="bytes per GPU and per node of each ZeRO stage and offload mode, and what fits",
        description=(
            "Model-state bytes per GPU and per node for each ZeRO stage and offload mode, in "
            "DeepSpeed's own estimator figures; exit code 1 when no mode fits the sizes given."
        ),
    )
    sizing.add_arguments(e)
    e.set_defaults(fn=sizing.main)

    for name, module, prefix, what in (
        ("consolidate", "minispeed.zero.__main__", ["consolidate"], "sharded checkpoint -> fp32"),
        ("trace", "minispeed.profiler.__main__", ["trace"], "Chrome trace of a training step"),
    ):
        d = sub.add_parser(name, help=what, add_help=False)
        d.add_argument("rest", nargs=argparse.REMAINDER)
        d.set_defaults(fn=_delegate(module, prefix))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The `minispeed` console script."""
    args = _parser().parse_args(argv)
    from minispeed.core.config import ConfigError
    from minispeed.engine.launcher import UsageError

    try:
        return args.fn(args)
    except (UsageError, ConfigError) as e:
        print(f"minispeed {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
