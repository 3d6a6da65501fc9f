"""``make demo``: train the small GPT with ZeRO-3 on 2 local processes, then write with it.

What you see, in order:

1. ``torchrun`` (``python -m torch.distributed.run``) starts 2 processes on this machine, gloo on
   the CPU; each runs ``examples/train_gpt.py --config examples/configs/zero3.json``, which trains
   through ``minispeed.engine.initialize`` (DeepSpeed's call): the model's parameters, gradients
   and AdamW state are split between the two ranks;
2. rank 0 shows a progress bar (loss, validation loss, tokens/s), then the memory ledger (model
   bytes per rank predicted by the ZeRO formulas vs measured) and the communication ledger (bytes
   per step predicted vs counted by the comms logger);
3. ``engine.describe()`` of rank 0: what ``initialize`` did to the model, step by step (the grid,
   the optimizer and the keys that chose it, the hooks ZeRO-3 installed and on which modules,
   each parameter's piece on this rank);
4. every rank saves its shard of a checkpoint; rank 0 consolidates them into one fp32 state_dict;
   the loss curve is written as ``loss_curve.png`` beside it;
5. back in this process, with no ZeRO at all: the consolidated weights are loaded into a plain
   ``GPT``, checked against the validation loss measured during training, and asked to write;
   ``minispeed.engine.init_inference`` (DeepSpeed's call) fuses its blocks and decodes with a KV
   cache, and its greedy text must equal the plain model's.

Options: ``--steps`` (default 400), ``--nproc`` (2), ``--config``, ``--out-dir``; any other
option goes to ``train_gpt.py`` (e.g. ``--n-layer 2 --n-embd 48``). The same training command scales by changing ``--nproc_per_node`` (and ``--nnodes`` with a rendezvous endpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from minispeed.core.files import atomic_write

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from data import CharDataset  # noqa: E402
from sample import generate_text, load_model  # noqa: E402

_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 60) -> str:
    """The values as one line of block characters (each block: the mean of its bin)."""
    if not values:
        return ""
    bins = [values[i * len(values) // width : (i + 1) * len(values) // width] for i in range(width)]
    means = [sum(b) / len(b) for b in bins if b]
    lo, hi = min(means), max(means)
    span = hi - lo or 1.0
    return "".join(_SPARK[min(len(_SPARK) - 1, int((m - lo) / span * len(_SPARK)))] for m in means)


def launch(args: argparse.Namespace, console: Console) -> None:
    """Run ``train_gpt.py`` on ``--nproc`` local processes with torchrun; raise if it fails."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a private rendezvous on a free local port
        "--nproc_per_node",
        str(args.nproc),
        str(HERE / "train_gpt.py"),
        "--config",
        str(args.config),
        "--steps",
        str(args.steps),
        "--out-dir",
        str(args.out_dir),
        *args.train_args,
    ]
    console.print(f"$ {' '.join(cmd)}", style="dim", markup=False, highlight=False)
    # One compute thread per process: 2 processes share this machine's cores (torchrun would set
    # the same and print a banner about it).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    result = subprocess.run(cmd, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(
            f"training failed (exit code {result.returncode}); see the rank tracebacks above"
        )


@torch.no_grad()
def consolidated_val_loss(model, metrics: dict) -> float:
    """Validation loss of the consolidated model on the exact batches training evaluated."""
    dataset = CharDataset.from_file()
    total, n = 0.0, metrics["eval_batches"]
    for i in range(n):
        x, y = dataset.batch(
            "val", i, metrics["eval_global_batch"], metrics["model"]["block_size"], metrics["seed"]
        )
        total += model(x, y)[1].item()
    return total / n


def report(metrics: dict, wall_s: float, console: Console) -> None:
    """The loss curve, the timings, and a consistency check of the consolidated weights."""
    losses = [loss for _, loss in metrics["losses"]]
    table = Table(
        title="loss curve (train: mean over ranks of each step's batch; val: 4 fixed batches)"
    )
    table.add_column("step", justify="right")
    table.add_column("train loss", justify="right")
    table.add_column("val loss", justify="right")
    val = dict((int(s), v) for s, v in metrics["val_losses"])
    marks = sorted({1, *val.keys()} - {0})
    for s in marks:
        table.add_row(str(s), f"{losses[s - 1]:.3f}", f"{val[s]:.3f}" if s in val else "")
    console.print(table)
    console.print(
        f"train loss  {sparkline(losses)}  {losses[0]:.2f} -> {losses[-1]:.2f}", highlight=False
    )
    console.print(
        f"{metrics['steps']} steps in {metrics['train_seconds']:.1f} s "
        f"({metrics['mean_step_seconds'] * 1e3:.0f} ms/step); demo wall time {wall_s:.1f} s",
        highlight=False,
    )


def plot_losses(metrics: dict, path: Path) -> Path:
    """The train and validation loss curves as a PNG at `path` (temporary file, fsync, rename)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    steps, train = zip(*metrics["losses"], strict=True)
    ax.plot(steps, train, label="train (mean over ranks)", linewidth=1)
    vs, val = zip(*metrics["val_losses"], strict=True)
    ax.plot(vs, val, "o-", label="validation", linewidth=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(
        f"GPT {metrics['num_params']:,} params, ZeRO-{metrics['stage']} on "
        f"{metrics['world_size']} ranks"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png"))
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    """Train, report, load the consolidated checkpoint and generate."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", default=str(HERE / "configs" / "zero3.json"))
    p.add_argument("--out-dir", default=".minispeed/demo")
    args, args.train_args = p.parse_known_args(argv)  # the rest goes to train_gpt.py
    console = Console()
    t0 = time.perf_counter()
    console.print(
        Panel.fit(
            "[bold]minispeed demo[/]: a small GPT learns the bundled essay on distributed training,\n"
            f"with ZeRO-3 on {args.nproc} local processes (gloo, CPU)",
            border_style="blue",
        )
    )
    launch(args, console)
    metrics = json.loads((Path(args.out_dir) / "metrics.json").read_text())
    # What initialize did to the model (engine.describe(), rank 0): the steps as they ran.
    console.print(
        Panel(metrics["describe"], title="engine.describe()", border_style="cyan"),
        highlight=False,
        markup=False,
    )
    # The sampling below is a tiny model: one thread avoids oversubscribing a busy machine.
    torch.set_num_threads(1)
    report(metrics, time.perf_counter() - t0, console)
    png = plot_losses(metrics, Path(args.out_dir) / "loss_curve.png")
    console.print(f"loss curve: {png}", highlight=False)

    model, tokenizer = load_model(args.out_dir)
    val_now = consolidated_val_loss(model, metrics)
    val_train = metrics["val_losses"][-1][1]
    # fp32 training: the consolidated weights are the model's weights. 16-bit training: they are
    # the fp32 masters, of which the model held a rounded copy, so only closeness is expected.
    tolerance = 1e-3 if metrics.get("param_dtype", "float32") == "float32" else 5e-2
    agree = abs(val_now - val_train) < tolerance
    console.print(
        f"consolidated fp32 weights loaded into a plain GPT: val loss {val_now:.4f} "
        f"(during training: {val_train:.4f}) "
        + ("[green]match[/]" if agree else "[red]MISMATCH: the checkpoint lost something[/]")
    )
    # DeepSpeed's inference call: fused kernels injected into the trained model, KV-cached
    # decoding; its greedy text must equal the plain model's token for token.
    import minispeed.engine as deepspeed
    from minispeed.inference import SamplingConfig, generate

    prompt = "The gradients "
    budget = metrics["model"]["block_size"] - len(prompt)  # the whole text fits the context
    engine = deepspeed.init_inference(
        load_model(args.out_dir)[0], dtype=torch.float32, replace_with_kernel_inject=True
    )
    new = generate(  # engine.fused: the fused model DeepSpeed's engine wraps
        engine.fused,
        [tokenizer.encode(prompt)],
        SamplingConfig(max_new_tokens=budget, temperature=0.0),
    )[0]
    injected = prompt + tokenizer.decode(new)
    plain = generate_text(model, tokenizer, prompt, max_new_tokens=budget, temperature=0.0)
    same = injected == plain
    console.print(
        f"init_inference ({', '.join(engine.injection_report.replaced)} fused, KV cache): greedy "
        + ("[green]same text as the plain model[/]" if same else "[red]TEXT DIFFERS[/]")
    )
    for prompt, temperature in (("The gradients ", 0.0), ("Stage three ", 0.8)):
        text = generate_text(
            model, tokenizer, prompt, max_new_tokens=240, temperature=temperature, seed=0
        )
        how = "greedy" if temperature == 0 else f"temperature {temperature}"
        console.print(Panel(text, title=f"sample ({how})", border_style="green"), highlight=False)
    console.print(f"[bold]done[/] in {time.perf_counter() - t0:.1f} s")
    if not (agree and same):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
