"""Train the small GPT of ``gpt.py`` on the bundled corpus with ZeRO, from a DeepSpeed-style config.

Launch it the way you would scale it (one process per rank; gloo on the CPU, nccl on GPUs)::

    python -m torch.distributed.run --nproc_per_node 2 examples/train_gpt.py \\
        --config examples/configs/zero3.json --steps 300 --out-dir .minispeed/demo

``python examples/train_gpt.py --config ...`` (no launcher) runs a single process.

What a run does, in order:

1. read the ds_config (``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
   ``gradient_clipping``, ``optimizer``, ``scheduler``, ``zero_optimization``, ``fp16``/``bf16``;
   any other top-level key is an error naming it), start the process group
   (``comm.init_distributed``);
2. build the model on every rank from the same seed and hand it to ``zero.shard`` with the user's
   optimizer (stage 3 partitions the parameters there);
3. train: each micro-step every rank takes its share of the same global batch
   (``data.CharDataset.batch``), ``opt.backward(loss)``, ``opt.step()``; the collectives of the
   training steps are recorded by a ``comm.CommsLogger`` (one logger step per optimizer step);
   the loss shown is the mean over ranks, all-reduced *outside* the logger so that it does not
   count as training traffic;
4. print the memory and communication ledgers, predicted vs measured (``ledgers.py``);
5. save a sharded checkpoint (every rank writes its fragments) and, on rank 0, consolidate it into
   one fp32 ``state_dict`` file that ``sample.py`` loads into a plain ``GPT``;
6. rank 0 writes ``metrics.json`` (loss curve, timings, ledgers) atomically.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.accelerator import get_accelerator
from minispeed.zero.checkpoints import consolidate, save_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt.py, data.py beside this file

import ledgers
from data import CORPUS_PATH, CharDataset
from gpt import GPT, GPTConfig

# Top-level ds_config keys this script understands (each is read below); anything else is an error.
_TRAIN_KEYS = {
    "train_micro_batch_size_per_gpu",
    "train_batch_size",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "optimizer",
    "scheduler",
    "zero_optimization",
    "fp16",
    "bf16",
    "data_types",
    "steps_per_print",
}
_OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}


@dataclass(frozen=True)
class TrainConfig:
    """The training-loop settings of a ds_config, with the batch arithmetic checked."""

    micro_batch: int
    """Sequences per rank per micro-step (``train_micro_batch_size_per_gpu``)."""
    grad_accum_steps: int
    """Micro-steps per optimizer step (``gradient_accumulation_steps``)."""
    world_size: int
    """Data-parallel ranks."""
    log_interval: int = 10
    """Optimizer steps between log lines when no progress bar is shown (``steps_per_print``)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "grad_accum_steps", "world_size", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks: micro_batch · grad_accum_steps · N."""
        return self.micro_batch * self.grad_accum_steps * self.world_size

    @classmethod
    def from_ds_config(cls, ds: dict[str, Any], world_size: int) -> TrainConfig:
        """Read the batch keys; ``train_batch_size``, when given, must equal micro · accum · N."""
        unknown = sorted(set(ds) - _TRAIN_KEYS)
        if unknown:
            raise ValueError(
                f"unknown ds_config key(s) {unknown}; train_gpt.py understands {sorted(_TRAIN_KEYS)}"
            )
        cfg = cls(
            micro_batch=int(ds.get("train_micro_batch_size_per_gpu", 16)),
            grad_accum_steps=int(ds.get("gradient_accumulation_steps", 1)),
            world_size=world_size,
            log_interval=int(ds.get("steps_per_print", 10)),
        )
        if "train_batch_size" in ds and int(ds["train_batch_size"]) != cfg.global_batch:
            raise ValueError(
                f"train_batch_size={ds['train_batch_size']} but train_micro_batch_size_per_gpu "
                f"({cfg.micro_batch}) x gradient_accumulation_steps ({cfg.grad_accum_steps}) x "
                f"world size ({world_size}) = {cfg.global_batch}; fix one of them or drop train_batch_size"
            )
        return cfg


def build_optimizer(ds: dict[str, Any], params) -> torch.optim.Optimizer:
    """The torch optimizer of the ds_config's ``optimizer`` section (default AdamW, lr 2e-3)."""
    section = ds.get("optimizer", {"type": "AdamW", "params": {"lr": 2e-3}})
    kind = section.get("type", "AdamW")
    if kind not in _OPTIMIZERS:
        raise ValueError(
            f"optimizer.type={kind!r} is not supported here; use one of {sorted(_OPTIMIZERS)}"
        )
    kwargs = dict(section.get("params", {}))
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return _OPTIMIZERS[kind](params, **kwargs)


def lr_at(step: int, ds: dict[str, Any], base_lr: float) -> float:
    """Learning rate of optimizer step ``step`` (1-based) under the ds_config's ``scheduler``.

    DeepSpeed's ``WarmupLR`` (from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps``, then constant) and ``WarmupDecayLR`` (then linearly to 0 at
    ``total_num_steps``); ``warmup_type`` "linear" or "log" (DeepSpeed's default). No scheduler:
    the optimizer's own ``lr`` throughout.
    """
    section = ds.get("scheduler")
    if section is None:
        return base_lr
    kind, params = section.get("type"), dict(section.get("params", {}))
    if kind not in ("WarmupLR", "WarmupDecayLR"):
        raise ValueError(
            f"scheduler.type={kind!r} is not supported here; use WarmupLR or WarmupDecayLR"
        )
    lo, hi = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", base_lr)
    warm = max(1, int(params.get("warmup_num_steps", 1000)))
    if step < warm:
        if params.get("warmup_type", "log") == "linear":
            frac = step / warm
        else:  # "log": fast at first, like DeepSpeed's default
            frac = math.log(step + 1) / math.log(warm + 1)
        return lo + (hi - lo) * frac
    if kind == "WarmupDecayLR":
        total = int(params["total_num_steps"])
        return hi * max(0.0, (total - step) / max(1, total - warm))
    return hi


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
    return p.parse_args(argv)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path``: temp file in the same folder, fsync, rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def mean_over_ranks(value: float) -> float:
    """The mean of a Python float over all ranks (one 4-byte all-reduce)."""
    t = torch.tensor([value], dtype=torch.float32, device=get_accelerator().device())
    comm.all_reduce(t)
    return t.item() / comm.get_world_size()


@torch.no_grad()
def evaluate(model: GPT, dataset: CharDataset, args, tcfg: TrainConfig, rank: int) -> float:
    """Mean validation loss over ``eval_batches`` fixed global batches (same on every call)."""
    model.eval()
    total = 0.0
    for i in range(args.eval_batches):
        x, y = dataset.batch(
            "val",
            i,
            tcfg.micro_batch * tcfg.world_size,
            args.block_size,
            args.seed,
            rank,
            tcfg.world_size,
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
    ds_config = json.loads(Path(args.config).read_text())
    owns_group = not comm.is_initialized()  # under a test harness the group is not ours to end
    comm.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    device = get_accelerator().device()
    tcfg = TrainConfig.from_ds_config(ds_config, world)
    zcfg = zero.ZeroConfig.from_ds_config(ds_config)
    precision = zero.MixedPrecision.from_ds_config(ds_config)
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
    report = Reporter(args.steps, tcfg.log_interval, enabled=rank == 0, bar=not args.no_progress)
    report.print(
        f"[bold]minispeed[/] GPT {num_params:,} parameters ({gcfg.n_layer} layers, width "
        f"{gcfg.n_embd}, vocab {gcfg.vocab_size}) | ZeRO stage {zcfg.stage} on {world} rank(s), "
        f"{comm_backend()} | global batch {tcfg.global_batch} x {gcfg.block_size} tokens | "
        f"params {str(precision.param_dtype).removeprefix('torch.')}"
    )
    paper_memory = ledgers.predict_memory(model, zcfg, precision, ds_config, world)

    optimizer = build_optimizer(ds_config, model.parameters())
    base_lr = optimizer.param_groups[0]["lr"]
    opt = zero.shard(model, optimizer, config=zcfg, precision=precision)

    log = comm.CommsLogger()
    losses: list[tuple[int, float]] = []
    val_losses: list[tuple[int, float]] = [(0, evaluate(model, dataset, args, tcfg, rank))]
    tokens_per_step = tcfg.global_batch * gcfg.block_size
    measured_memory: dict[str, Any] = {}
    step_times: list[float] = []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        step_loss = 0.0
        for group in opt.optimizer.param_groups:  # the inner optimizer steps the masters
            group["lr"] = lr_at(step, ds_config, base_lr)
        with log:  # only the training step's collectives are recorded
            if step > 1:
                log.mark_step()
            for micro in range(tcfg.grad_accum_steps):
                x, y = dataset.batch(
                    "train",
                    (step - 1) * tcfg.grad_accum_steps + micro,
                    tcfg.micro_batch * world,
                    gcfg.block_size,
                    args.seed,
                    rank,
                    world,
                )
                _, loss = model(x.to(device), y.to(device))
                opt.backward(loss)
                if step == min(2, args.steps) and micro == tcfg.grad_accum_steps - 1:
                    # After the last backward of step 2, before its optimizer step: the optimizer
                    # state exists (created lazily by step 1) and so do the reduced gradients
                    # (the step clears them).
                    measured_memory = ledgers.measure_memory(opt, model)
                opt.step()  # acts at the accumulation boundary only, then clears the gradients
                step_loss += loss.item() / tcfg.grad_accum_steps
        step_times.append(time.perf_counter() - t0)
        loss_mean = mean_over_ranks(step_loss)
        if not math.isfinite(loss_mean):
            raise FloatingPointError(
                f"loss became {loss_mean} at step {step}; lower the learning rate"
            )
        losses.append((step, loss_mean))
        if step % args.eval_interval == 0 or step == args.steps:
            val_losses.append((step, evaluate(model, dataset, args, tcfg, rank)))
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
        checkpoint = save_and_consolidate(opt, model, out_dir, rank, report)

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
            "global_batch": tcfg.global_batch,
            "micro_batch": tcfg.micro_batch,
            "seed": args.seed,
            "eval_batches": args.eval_batches,
            "eval_global_batch": tcfg.micro_batch * world,
            "steps": args.steps,
            "train_seconds": train_s,
            "mean_step_seconds": sum(step_times[1:]) / max(1, len(step_times) - 1),
            "losses": losses,
            "val_losses": val_losses,
            "memory_ledger": memory_rows,
            "comm_ledger": comm_rows,
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
    opt, model: GPT, out_dir: Path, rank: int, report: Reporter
) -> dict[str, Any]:
    """Every rank writes its shard; rank 0 joins them into ``consolidated_fp32.pt``."""
    t0 = time.perf_counter()
    tag_dir = save_checkpoint(opt, model, out_dir / "checkpoint")
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
