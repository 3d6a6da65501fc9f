"""Train the small GPT of ``gpt.py`` on the bundled corpus with ZeRO, from a DeepSpeed-style config.

Launch it the way you would scale it (one process per rank; gloo on the CPU, nccl on GPUs)::

    python -m torch.distributed.run --nproc_per_node 2 examples/train_gpt.py \\
        --config examples/configs/zero3.json --steps 300 --out-dir .minispeed/demo

``python examples/train_gpt.py --config ...`` (no launcher) runs a single process.

What a run does, in order:

1. start the process group (``comm.init_distributed``) and build the model on every rank from
   the same seed;
2. ``minispeed.engine.initialize(model=..., config=path)``, DeepSpeed's call: it reads and checks
   the whole ds_config (the batch triple, ``optimizer`` and ``scheduler`` by name,
   ``zero_optimization``, ``fp16``/``bf16``, ``gradient_clipping``, ``steps_per_print``; an
   unknown key is an error naming it) and shards the model with ``zero.shard`` (stage 3
   partitions the parameters there);
3. train: each micro-step every rank takes its share of the same global batch
   (``data.CharDataset.batch``), ``engine(x, y)``, ``engine.backward(loss)``, ``engine.step()``
   (the scheduler steps with the optimizer); the collectives of the training steps are recorded
   by a ``comm.CommsLogger`` (one logger step per optimizer step);
   the loss shown is the mean over ranks, all-reduced *outside* the logger so that it does not
   count as training traffic;
4. print the memory and communication ledgers, predicted vs measured (``ledgers.py``);
5. save a sharded checkpoint (``engine.save_checkpoint``: every rank writes its fragments) and, on
   rank 0, consolidate it into
   one fp32 ``state_dict`` file that ``sample.py`` loads into a plain ``GPT``;
6. rank 0 writes ``metrics.json`` (loss curve, timings, ledgers) atomically.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import minispeed.comm as comm
import minispeed.engine as deepspeed
from minispeed.core.accelerator import get_accelerator
from minispeed.core.files import atomic_write_json
from minispeed.engine.config import EngineConfig, load_ds_config
from minispeed.zero.checkpoints import consolidate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt.py, data.py beside this file

import ledgers
from data import CORPUS_PATH, CharDataset
from gpt import GPT, GPTConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options: the ds_config, the run length, the model size and the outputs."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="DeepSpeed-style ds_config JSON file")
    p.add_argument("--steps", type=int, default=250, help="optimizer steps to train")
    p.add_argument("--out-dir", default=".minispeed/train_gpt", help="checkpoint, metrics, logs")
    p.add_argument("--data", default=str(CORPUS_PATH), help="UTF-8 text file to train on")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=96)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--eval-interval", type=int, default=50, help="steps between validation losses")
    p.add_argument("--eval-batches", type=int, default=4, help="global batches per validation")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    p.add_argument("--no-checkpoint", action="store_true", help="skip saving and consolidating")
    p.add_argument("--local_rank", type=int, default=-1, help="set by launchers; unused")
    return p.parse_args(argv)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path``, whole or not at all (``minispeed.core.files``)."""
    atomic_write_json(path, obj)


def mean_over_ranks(value: float) -> float:
    """The mean of a Python float over all ranks (one 4-byte all-reduce)."""
    t = torch.tensor([value], dtype=torch.float32, device=get_accelerator().device())
    comm.all_reduce(t)
    return t.item() / comm.get_world_size()


@torch.no_grad()
def evaluate(model: GPT, dataset: CharDataset, args, cfg: EngineConfig, rank: int) -> float:
    """Mean validation loss over ``eval_batches`` fixed global batches (same on every call)."""
    model.eval()
    total = 0.0
    for i in range(args.eval_batches):
        x, y = dataset.batch(
            "val",
            i,
            cfg.micro_batch_size * cfg.data_parallel_size,
            args.block_size,
            args.seed,
            rank,
            cfg.data_parallel_size,
        )
        device = get_accelerator().device()
        _, loss = model(x.to(device), y.to(device))
        total += loss.item()
    model.train()
    return mean_over_ranks(total / args.eval_batches)


class Reporter:
    """Rank 0's view of the run: a rich progress bar on a terminal, log lines otherwise."""

    def __init__(self, total_steps: int, log_interval: int, enabled: bool, bar: bool) -> None:
        from rich.console import Console

        self.console = Console()
        if not self.console.is_terminal:  # logs and pipes: wide enough for the ledger tables
            self.console = Console(width=120)
        self.enabled = enabled
        self.log_interval = log_interval
        self.progress = None
        if enabled and bar and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                TextColumn("[bold blue]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss [bold]{task.fields[loss]}"),
                TextColumn("val {task.fields[val]}"),
                TextColumn("{task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.task = self.progress.add_task(
                "train", total=total_steps, loss="-", val="-", tps="-"
            )
            self.progress.start()

    def print(self, *objects: Any) -> None:
        """Print on rank 0 (above the bar while it runs)."""
        if self.enabled:
            self.console.print(*objects)

    def update(self, step: int, loss: float, val: tuple[int, float], tokens_per_s: float) -> None:
        """Advance to ``step`` (1-based) with the latest numbers; ``val`` = (its step, loss)."""
        if not self.enabled:
            return
        val_s = f"{val[1]:.3f}" if self.progress is not None or val[0] == step else "-"
        if self.progress is not None:
            self.progress.update(
                self.task, completed=step, loss=f"{loss:.3f}", val=val_s, tps=f"{tokens_per_s:,.0f}"
            )
        elif step == 1 or step % self.log_interval == 0:
            self.console.print(
                f"step {step:>5}  loss {loss:.3f}  val {val_s}  {tokens_per_s:,.0f} tok/s",
                highlight=False,
            )

    def close(self) -> None:
        """Stop the live bar."""
        if self.progress is not None:
            self.progress.stop()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run one training job; returns rank 0's metrics (other ranks: an empty dict)."""
    args = parse_args(argv)
    ds_config = load_ds_config(args.config)
    owns_group = not comm.is_initialized()  # under a test harness the group is not ours to end
    comm.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    device = get_accelerator().device()
    out_dir = Path(args.out_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    dataset = CharDataset.from_file(args.data)
    gcfg = GPTConfig(
        vocab_size=dataset.tokenizer.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
    )
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(gcfg).to(device)
    num_params = model.num_params()
    # The ZeRO paper's figures need the full model: predicted before stage 3 partitions it.
    resolved = EngineConfig.from_ds_config(ds_config, data_parallel_size=world)
    paper_memory = ledgers.predict_memory(
        model, resolved.zero, resolved.precision, ds_config, world
    )

    # DeepSpeed's call: the optimizer and scheduler come from the config by name.
    engine, opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    described = engine.describe()  # the steps initialize ran, as they ran (rank 0's is kept)
    cfg = engine.config
    zcfg, precision = cfg.zero, cfg.precision
    report = Reporter(
        args.steps, cfg.steps_per_print or 10, enabled=rank == 0, bar=not args.no_progress
    )
    report.print(
        f"[bold]minispeed[/] GPT {num_params:,} parameters ({gcfg.n_layer} layers, width "
        f"{gcfg.n_embd}, vocab {gcfg.vocab_size}) | ZeRO stage {zcfg.stage} on {world} rank(s), "
        f"{comm_backend()} | global batch {cfg.train_batch_size} x {gcfg.block_size} tokens | "
        f"params {str(precision.param_dtype).removeprefix('torch.')}"
    )

    log = comm.CommsLogger()
    losses: list[tuple[int, float]] = []
    val_losses: list[tuple[int, float]] = [(0, evaluate(model, dataset, args, cfg, rank))]
    tokens_per_step = cfg.train_batch_size * gcfg.block_size
    gas = cfg.gradient_accumulation_steps
    measured_memory: dict[str, Any] = {}
    step_times: list[float] = []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        step_loss = 0.0
        with log:  # only the training step's collectives are recorded
            if step > 1:
                log.mark_step()
            for micro in range(gas):
                x, y = dataset.batch(
                    "train",
                    (step - 1) * gas + micro,
                    cfg.micro_batch_size * world,
                    gcfg.block_size,
                    args.seed,
                    rank,
                    world,
                )
                _, loss = engine(x, y)  # the engine moves the batch to its device
                engine.backward(loss)
                if step == min(2, args.steps) and micro == gas - 1:
                    # After the last backward of step 2, before its optimizer step: the optimizer
                    # state exists (created lazily by step 1) and so do the reduced gradients
                    # (the step clears them).
                    measured_memory = ledgers.measure_memory(opt, model)
                engine.step()  # acts at the accumulation boundary only (optimizer, scheduler)
                step_loss += loss.item() / gas
        step_times.append(time.perf_counter() - t0)
        loss_mean = mean_over_ranks(step_loss)
        if not math.isfinite(loss_mean):
            raise FloatingPointError(
                f"loss became {loss_mean} at step {step}; lower the learning rate"
            )
        losses.append((step, loss_mean))
        if step % args.eval_interval == 0 or step == args.steps:
            val_losses.append((step, evaluate(model, dataset, args, cfg, rank)))
        recent = step_times[-10:]
        report.update(step, loss_mean, val_losses[-1], tokens_per_step * len(recent) / sum(recent))
    train_s = time.perf_counter() - t_start
    report.close()

    memory_rows = ledgers.memory_ledger(paper_memory, measured_memory)
    comm_rows = ledgers.comm_ledger(opt, model, log, zcfg, precision, world, args.steps)
    if rank == 0:
        ledgers.print_ledgers(report.console, memory_rows, comm_rows, zcfg.stage, world)

    checkpoint: dict[str, Any] = {}
    if not args.no_checkpoint:
        checkpoint = save_and_consolidate(engine, out_dir, rank, report)

    metrics: dict[str, Any] = {}
    if rank == 0:
        metrics = {
            "config": args.config,
            "world_size": world,
            "stage": zcfg.stage,
            "param_dtype": str(precision.param_dtype).removeprefix("torch."),
            "num_params": num_params,
            "model": asdict(gcfg),
            "tokenizer_chars": dataset.tokenizer.chars,
            "global_batch": cfg.train_batch_size,
            "micro_batch": cfg.micro_batch_size,
            "seed": args.seed,
            "eval_batches": args.eval_batches,
            "eval_global_batch": cfg.micro_batch_size * world,
            "steps": args.steps,
            "train_seconds": train_s,
            "mean_step_seconds": sum(step_times[1:]) / max(1, len(step_times) - 1),
            "losses": losses,
            "val_losses": val_losses,
            "final_lr": engine.get_lr(),
            "memory_ledger": memory_rows,
            "comm_ledger": comm_rows,
            "describe": described,  # what initialize did to the model, on rank 0
            **checkpoint,
        }
        write_json_atomic(out_dir / "metrics.json", metrics)
    comm.barrier()
    if owns_group:
        comm.destroy_process_group()
    return metrics


def comm_backend() -> str:
    """The process group's backend, for the banner."""
    return get_accelerator().communication_backend()


def save_and_consolidate(
    engine: deepspeed.Engine, out_dir: Path, rank: int, report: Reporter
) -> dict[str, Any]:
    """Every rank writes its shard; rank 0 joins them into ``consolidated_fp32.pt``."""
    t0 = time.perf_counter()
    engine.save_checkpoint(out_dir / "checkpoint")
    tag_dir = out_dir / "checkpoint" / f"global_step{engine.global_steps}"
    comm.barrier()
    saved_s = time.perf_counter() - t0
    result: dict[str, Any] = {"checkpoint_dir": str(tag_dir), "save_seconds": saved_s}
    if rank == 0:
        t0 = time.perf_counter()
        rep = consolidate(out_dir / "checkpoint", out_dir / "consolidated_fp32.pt")
        result |= {
            "consolidated_file": str(rep.out_file),
            "consolidate_seconds": time.perf_counter() - t0,
            "consolidated_bytes": rep.total_bytes,
        }
        report.print(
            f"checkpoint: {tag_dir} (sharded, saved in {saved_s:.2f} s) -> {rep.out_file} "
            f"({rep.total_bytes / 2**20:.2f} MiB fp32, peak held {rep.peak_held_bytes / 2**20:.2f} MiB)"
        )
    return result


if __name__ == "__main__":
    main()
