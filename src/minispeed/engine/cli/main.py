"""The `minispeed` command: one entry point for launching, checking and inspecting.

```bash
minispeed run --nproc_per_node 2 train.py --deepspeed_config ds.json   # see cli/launcher.py
minispeed report [--config ds.json]      # environment and ops; the config the engine resolves
minispeed config schema|reference        # the ds_config's JSON Schema, or its reference page
minispeed consolidate CKPT_DIR OUT.pt    # a sharded checkpoint -> one fp32 state_dict
minispeed estimate --params 7e9 --gpus 8 --nodes 1 --gpu-mem 80 --cpu-mem 512   # cli/sizing.py
minispeed tune --budget 10m train.py --config ds.json   # engine/tune: short real trials
minispeed trace ...                      # the profiler's Chrome trace of a step
```

`consolidate` and `trace` are the packages' own command lines (`minispeed.zero`,
`minispeed.profiler`) behind one name: every argument, `--help` too, passes through. Exit codes
scripts can test: 0 on success; 2 on bad input, before anything starts (the reason and the fix
on stderr); `run`: the first failed rank's own code; `estimate`: 1 when sizes were given and no
stage or offload mode fits; `tune`: 1 when no trial succeeded; `consolidate`: 1 for an
unreadable checkpoint. One page per subcommand: docs/cli/.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from minispeed.engine.cli import sizing
from minispeed.engine.cli.launcher import UsageError

__all__ = ["main"]


def _run(args: argparse.Namespace) -> int:
    from minispeed.engine.cli.launcher import LaunchArgs, run

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
            no_local_rank=args.no_local_rank,
        )
    )


def _report(args: argparse.Namespace) -> int:
    from minispeed.core.report import main as report_main

    if args.config is None:
        return report_main([])
    from rich.console import Console

    from minispeed.engine.cli.resolved import resolved_table
    from minispeed.engine.config import EngineConfig

    # Resolved first: a bad config is an error (exit code 2) before the long environment report.
    cfg = EngineConfig.load(args.config, data_parallel_size=args.world_size)
    code = report_main([])
    title = f"resolved config: {args.config}, data-parallel size {args.world_size}"
    Console(width=max(Console().width, 120)).print(resolved_table(cfg, title))
    return code


def _tune_options(p: argparse.ArgumentParser, suppress: bool) -> None:
    """The tuner's own flags (accepted before or after the script; the rest goes to it)."""
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    p.add_argument("--budget", default=d(None), help="time for the whole search: 90s, 10m, 1h")
    p.add_argument("--nproc_per_node", "--num_gpus", dest="nproc_per_node", type=int,
                   default=d(1), help="processes per trial")  # fmt: skip
    p.add_argument("--out", default=d(".minispeed/tune"), help="where results and logs go")
    p.add_argument("--trial-steps", type=int, default=d(6), help="optimizer steps per trial")
    p.add_argument("--warmup-steps", type=int, default=d(2), help="untimed steps first")
    p.add_argument(
        "--gpu-mem", type=float, default=d(None), help="GiB per device (default: its own)"
    )
    p.add_argument("--params", type=float, default=d(None), help="Ψ, if known before a trial")


def _script_config(script_args: Sequence[str]) -> str:
    """The ds_config path the script is given (`--config`, `--deepspeed_config`)."""
    for i, arg in enumerate(script_args):
        for flag in ("--config", "--deepspeed_config"):
            if arg == flag and i + 1 < len(script_args):
                return script_args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    raise UsageError(
        "minispeed tune reads the config from the script's arguments: give the script "
        "--config cfg.json (or --deepspeed_config cfg.json)"
    )


def _tune(args: argparse.Namespace) -> int:
    from rich.console import Console

    from minispeed.engine.cli.launcher import LaunchArgs, torchrun_argv
    from minispeed.engine.config import EngineConfig, load_ds_config
    from minispeed.engine.tune.memory import device_memory_bytes
    from minispeed.engine.tune.search import (
        TrialResult,
        TuneSettings,
        parse_budget,
        run_trial,
        tune,
    )

    late = argparse.ArgumentParser(add_help=False)
    _tune_options(late, suppress=True)
    found, script_args = late.parse_known_args(args.rest)
    vars(args).update(vars(found))
    if args.budget is None:
        raise UsageError("give the search's time: --budget 10m")
    budget = parse_budget(args.budget)
    for flag, value in (
        ("--trial-steps", args.trial_steps),
        ("--nproc_per_node", args.nproc_per_node),
    ):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.warmup_steps < args.trial_steps:
        raise UsageError(
            f"need 0 <= --warmup-steps < --trial-steps, got {args.warmup_steps} and {args.trial_steps}"
        )
    # Everything checked before the first trial starts: the script, the launch, the config.
    torchrun_argv(
        LaunchArgs(script=args.script, script_args=script_args, nproc_per_node=args.nproc_per_node)
    )
    base = load_ds_config(_script_config(script_args))
    EngineConfig.from_ds_config(base, data_parallel_size=args.nproc_per_node)
    memory = (
        device_memory_bytes(args.nproc_per_node)
        if args.gpu_mem is None
        else int(args.gpu_mem * 2**30)
    )
    if memory <= 0:
        raise UsageError(f"--gpu-mem must be > 0 GiB, got {args.gpu_mem}")
    settings = TuneSettings(
        base_config=base,
        world_size=args.nproc_per_node,
        budget_seconds=budget,
        out_dir=Path(args.out),
        device_memory_bytes=memory,
        num_params=None if args.params is None else int(args.params),
    )
    runner = run_trial(
        args.script, script_args, args.nproc_per_node, args.trial_steps, args.warmup_steps
    )
    console = Console(width=max(Console().width, 160))

    def progress(i: int, t: TrialResult) -> None:
        figure = f"{t.samples_per_second:,.1f} samples/s" if t.samples_per_second else t.reason
        console.print(
            f"trial {i}: {t.candidate.label}: {t.outcome.value}, {figure}", highlight=False
        )

    report = tune(settings, runner, progress)
    console.print(report.table())
    if report.best is None:
        console.print(
            "[red]no trial succeeded[/]; see the reasons above and the logs in " + args.out
        )
        return 1
    console.print(
        f"fastest: {report.best.candidate.label} ({report.best.samples_per_second:,.1f} samples/s); "
        f"wrote {Path(args.out) / 'best_config.json'} and {Path(args.out) / 'trials.json'}"
    )
    return 0


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


#: Subcommands that are a package's own command line: every argument (`--help` too) goes to it.
_DELEGATES = {
    "consolidate": (
        "minispeed.engine.cli.consolidate",
        ["consolidate"],
        "sharded checkpoint -> fp32",
    ),
    "trace": ("minispeed.profiler.__main__", ["trace"], "Chrome trace of a training step"),
}


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
    r.add_argument(
        "--no_local_rank",
        action="store_true",
        help="do not pass --local_rank=N to the script (LOCAL_RANK is set anyway)",
    )
    r.add_argument("script", nargs=argparse.REMAINDER, help="script and its arguments")
    r.set_defaults(fn=_run)

    t = sub.add_parser(
        "tune",
        help="search ZeRO stage, batch, buckets and offload with short real runs",
        description="Find the fastest config by running short trials of the script (see "
        "minispeed.engine.tune); exit code 0 with a best config, 1 when no trial succeeded.",
    )
    _tune_options(t, suppress=False)
    t.add_argument("script", help="the training script (it calls minispeed.engine.initialize)")
    t.add_argument("rest", nargs=argparse.REMAINDER, help="its arguments, with --config cfg.json")
    t.set_defaults(fn=_tune)

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

    for name, (module, prefix, what) in _DELEGATES.items():
        d = sub.add_parser(name, help=what, add_help=False)
        d.add_argument("rest", nargs=argparse.REMAINDER)
        d.set_defaults(fn=_delegate(module, prefix))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The `minispeed` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _DELEGATES:  # before argparse, which would take `--help` itself
        module, prefix, _ = _DELEGATES[argv[0]]
        return _delegate(module, prefix)(argparse.Namespace(rest=argv[1:]))
    args = _parser().parse_args(argv)
    from minispeed.core.config import ConfigError
    from minispeed.engine.cli.launcher import UsageError

    try:
        return args.fn(args)
    except (UsageError, ConfigError) as e:
        print(f"minispeed {args.command}: {e}", file=sys.stderr)
        return 2


def deepspeed_main() -> int:
    """DeepSpeed's `deepspeed` launcher command, which the `deepspeed` distribution
    (packages/deepspeed_compat) installs: `minispeed run` with the same arguments
    (`deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json`)."""
    return main(["run", *sys.argv[1:]])


def ds_report_main() -> int:
    """DeepSpeed's `ds_report` command: `minispeed report`."""
    return main(["report", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
