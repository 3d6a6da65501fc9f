"""`minispeed estimate`: which ZeRO stage and offload mode fit a model on a cluster.

```bash
minispeed estimate --params 7e9 --gpus 8 --nodes 1 --gpu-mem 80 --cpu-mem 512
minispeed estimate --model hf-config.json --gpus 8 --gpu-mem 80     # Ψ and L from the config
minispeed estimate --params 7e9 --gpus 8 --nodes 4 --mics-shard-size 8  # + MiCS over one node
```

One row per (stage, offload mode, zero_init) with the model-state bytes per GPU, per node (the
node's GPUs together, its CPU memory, its NVMe) and whether it fits, in DeepSpeed's own figures
(`minispeed.zero.memory.modes`, equal to `estimate_zero2/3_model_states_mem_needs_*`). With
`--model`, the Hugging Face config is built on the meta device (no memory, no weights) to count
Ψ and the largest layer L as DeepSpeed's `_all_live` does; `transformers` is needed only then.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from minispeed.engine.cli import cluster_time, sizing_paper
from minispeed.engine.cli.launcher import UsageError

__all__ = ["add_arguments", "count_hf_config", "main"]

GiB = 2**30


_FLAGS = {
    "a parameter count": "--params",
    "largest_layer_params": "--largest-layer",
    "additional_buffer_factor": "--buffer-factor",
}
"""`estimate_modes`'s names in its errors -> the flags they came from."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `estimate` flags (DeepSpeed's estimator arguments under CLI names)."""
    p.add_argument("--params", type=float, help="parameter count Ψ, e.g. 7e9 (or --model)")
    p.add_argument("--model", help="a Hugging Face config.json: Ψ and L counted from it")
    p.add_argument(
        "--largest-layer", type=float, help="parameters of the largest layer L (stage 3 gathers it)"
    )
    p.add_argument("--gpus", type=int, help="GPUs per node (DeepSpeed's num_gpus; default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (DeepSpeed's num_nodes)")
    p.add_argument("--gpu-mem", type=float, help="GiB of memory per GPU, to say what fits")
    p.add_argument("--cpu-mem", type=float, help="GiB of CPU memory per node, to say what fits")
    p.add_argument(
        "--buffer-factor", type=float, default=1.5, help="DeepSpeed's additional_buffer_factor"
    )
    p.add_argument(
        "--mics-shard-size",
        type=int,
        help="also the stage-3 rows under MiCS with shard groups of S GPUs (whole nodes)",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    p.add_argument("--nvme-mem", type=float, help="GiB of NVMe per node, to say what fits")
    p.add_argument(
        "--largest", action="store_true", help="the largest Ψ each row fits in the sizes given"
    )
    p.add_argument(
        "--paper", action="store_true", help="the ZeRO paper's Table 1 for --params at --dp"
    )
    p.add_argument("--dp", help="data-parallel degrees for --paper, e.g. 1,4,16,64,256,1024")
    cluster_time.add_arguments(p)


def count_hf_config(path: str | Path) -> tuple[int, int]:
    """(Ψ, L) of the causal-LM a Hugging Face `config.json` describes, built on the meta device."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--model {str(p)!r} does not exist; give a Hugging Face config.json")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"--model {str(p)!r} is not JSON: {e}") from None
    if "model_type" not in raw:
        raise UsageError(f"--model {str(p)!r} has no 'model_type'; give a Hugging Face config.json")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from minispeed.zero.memory.modes import count_params

    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return count_params(model)


def main(args: argparse.Namespace) -> int:
    """Print the table (or JSON); exit code 0, or 1 when no row fits the sizes given."""
    from rich.console import Console
    from rich.table import Table

    from minispeed.zero.memory.modes import estimate_modes

    if args.largest:
        return _largest(args)
    if (args.params is None) == (args.model is None):
        raise UsageError("give the model size: --params N or --model config.json (one of them)")
    if args.paper or args.time:
        return _published(args)
    args.gpus = 1 if args.gpus is None else args.gpus
    _check_sizes(args)
    if args.model is not None:
        psi, largest = count_hf_config(args.model)
        largest = largest if args.largest_layer is None else args.largest_layer
    else:
        psi, largest = args.params, args.largest_layer
    try:
        rows = estimate_modes(
            psi,
            args.gpus,
            args.nodes,
            largest_layer_params=largest,
            additional_buffer_factor=args.buffer_factor,
            mics_shard_size=args.mics_shard_size,
        )
    except ValueError as e:  # the estimator's argument names, as this command's flags
        message = str(e)
        for arg, flag in _FLAGS.items():
            message = message.replace(arg, flag)
        raise UsageError(message) from None
    gpu_cap, cpu_cap, nvme_cap = _caps(args)
    fits = [r.fits(gpu_cap, cpu_cap, nvme_cap) for r in rows]
    if args.json:
        print(json.dumps([
            {"stage": r.stage, "offload": r.offload.value, "zero_init": r.zero_init,
             "gpu_bytes": r.gpu_bytes, "gpu_bytes_per_node": r.gpu_bytes * args.gpus,
             "cpu_bytes_per_node": r.cpu_bytes_per_node,
             "nvme_bytes_per_node": r.nvme_bytes_per_node, "fits": ok, "source": r.source,
             "mics_shard_size": r.mics_shard_size}
            for r, ok in zip(rows, fits, strict=True)
        ], indent=1))  # fmt: skip
    else:
        psi_n = int(psi)
        table = Table(
            title=(
                f"Ψ = {psi_n:,}, L = {int(largest or 0):,}; {args.nodes} node(s) x {args.gpus} "
                "GPU(s)"
                + (f", {args.gpu_mem:g} GiB/GPU" if gpu_cap else "")
                + (f", {args.cpu_mem:g} GiB CPU/node" if cpu_cap else "")
            ),
            caption=(
                "model states in DeepSpeed's estimate_zero2/3 figures (stages 0-1, NVMe: "
                "extended); activations come on top"
                + ("; L unknown: give --largest-layer or --model" if not largest else "")
            ),
        )
        for col in ("stage", "offload", "zero_init", "per GPU", "GPUs per node", "CPU per node",
                    "NVMe per node", "fits"):  # fmt: skip
            table.add_column(col, justify="right" if "per" in col else "left")
        for r, ok in zip(rows, fits, strict=True):
            table.add_row(
                str(r.stage) if r.mics_shard_size is None else f"3 MiCS S={r.mics_shard_size}",
                r.offload.value,
                "-" if r.zero_init is None else str(int(r.zero_init)),
                _gib(r.gpu_bytes),
                _gib(r.gpu_bytes * args.gpus),
                _gib(r.cpu_bytes_per_node),
                _gib(r.nvme_bytes_per_node) if r.nvme_bytes_per_node else "-",
                "-" if ok is None else ("[green]yes[/]" if ok else "[red]no[/]"),
            )
        Console(width=max(Console().width, 120)).print(table)
    return 1 if any(f is False for f in fits) and not any(fits) else 0


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f} GiB"


def _published(args: argparse.Namespace) -> int:
    """`--paper` (sizing_paper) and `--time` (cluster_time): Ψ from --params or --model."""
    _check_sizes(args)
    psi = count_hf_config(args.model)[0] if args.model is not None else args.params
    if args.paper:
        args.gpus = 1 if args.gpus is None else args.gpus
        sizing_paper.print_paper_table(_whole(psi, "--params"), _degrees(args), args.json)
        return 0
    return cluster_time.main(args, _whole(psi, "--params"))  # --gpus None: the cluster's


def _check_sizes(args: argparse.Namespace) -> None:
    """--gpus / --nodes >= 1 and the memories > 0 (finite), before any arithmetic."""
    for name in ("gpus", "nodes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")
    for name in ("gpu_mem", "cpu_mem", "nvme_mem"):
        value = getattr(args, name)
        if value is not None and not 0 < value < float("inf"):
            raise UsageError(
                f"--{name.replace('_', '-')} must be a finite number > 0 GiB, got {value}"
            )


def _caps(args: argparse.Namespace) -> tuple[int | None, int | None, int | None]:
    """The memories given, in bytes (None where not given)."""
    return tuple(
        None if v is None else int(v * GiB) for v in (args.gpu_mem, args.cpu_mem, args.nvme_mem)
    )


def _whole(value: float, flag: str) -> int:
    """A count given as a float (7.5e9) as a whole number, or a UsageError naming the flag."""
    if not (math.isfinite(value) and value >= 1 and value == int(value)):
        raise UsageError(f"{flag} must be a whole number >= 1, got {value}")
    return int(value)


def _degrees(args: argparse.Namespace) -> list[int]:
    """--dp's degrees (default: --gpus x --nodes)."""
    if args.dp is None:
        return [args.gpus * args.nodes]
    try:
        degrees = [int(d) for d in args.dp.split(",")]
    except ValueError:
        raise UsageError(f"--dp takes whole numbers separated by commas, got {args.dp!r}") from None
    if any(d < 1 for d in degrees):
        raise UsageError(f"--dp degrees must be >= 1, got {args.dp!r}")
    return degrees


def _largest(args: argparse.Namespace) -> int:
    """`--largest`: the largest Ψ each (stage, offload) row fits in the memories given."""
    from rich.console import Console
    from rich.table import Table

    from minispeed.zero.memory.modes import largest_params

    _check_sizes(args)
    args.gpus = 1 if args.gpus is None else args.gpus
    if args.params is not None or args.model is not None:
        raise UsageError("--largest finds Ψ: give the memories (--gpu-mem, --cpu-mem, "
                         "--nvme-mem), not --params or --model")  # fmt: skip
    gpu_cap, cpu_cap, nvme_cap = _caps(args)
    if gpu_cap is None and cpu_cap is None and nvme_cap is None:
        raise UsageError("--largest needs the memories: --gpu-mem (and --cpu-mem, --nvme-mem)")
    layer = 0 if args.largest_layer is None else _whole(args.largest_layer, "--largest-layer")
    if not 0 < args.buffer_factor < float("inf"):
        raise UsageError(f"--buffer-factor must be a finite number > 0, got {args.buffer_factor}")
    try:
        found = largest_params(
            args.gpus, args.nodes, gpu_bytes=gpu_cap, cpu_bytes_per_node=cpu_cap,
            nvme_bytes_per_node=nvme_cap, largest_layer_params=layer,
            additional_buffer_factor=args.buffer_factor,
        )  # fmt: skip
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps([
            {"stage": r.stage, "offload": r.offload.value, "zero_init": r.zero_init,
             "largest_params": psi, "gpu_bytes": r.gpu_bytes,
             "cpu_bytes_per_node": r.cpu_bytes_per_node,
             "nvme_bytes_per_node": r.nvme_bytes_per_node}
            for r, psi in found
        ], indent=1))  # fmt: skip
        return 0 if any(psi for _, psi in found) else 1
    given = ((args.gpu_mem, "/GPU"), (args.cpu_mem, "CPU/node"), (args.nvme_mem, "NVMe/node"))
    table = Table(
        title=f"largest Ψ per mode: {args.nodes} node(s) x {args.gpus} GPU(s)"
        + "".join(f", {v:g} GiB {what}" for v, what in given if v is not None),
        caption=f"DeepSpeed's estimator figures, L = {layer:,}, buffer factor {args.buffer_factor:g};"
        " '-': no size given limits it",
    )
    for col in ("stage", "offload", "zero_init", "largest Ψ", "per GPU", "CPU per node",
                "NVMe per node"):  # fmt: skip
        table.add_column(col, justify="right" if col not in ("offload",) else "left")
    for r, psi in found:
        table.add_row(
            str(r.stage), r.offload.value, "-" if r.zero_init is None else str(int(r.zero_init)),
            "-" if psi is None else f"{psi / 1e9:,.1f}B", _gib(r.gpu_bytes),
            _gib(r.cpu_bytes_per_node),
            _gib(r.nvme_bytes_per_node) if r.nvme_bytes_per_node else "-",
        )  # fmt: skip
    Console(width=max(Console().width, 120)).print(table)
    return 0 if any(psi for _, psi in found) else 1
