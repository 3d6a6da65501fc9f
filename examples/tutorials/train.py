"""One DeepSpeed-style training script for every composition tutorial (docs/tutorials/).

Written the way a DeepSpeed script is written: `add_config_arguments`, `initialize(args=...)`,
`engine(x, y)`, `engine.backward(loss)`, `engine.step()`. The config alone selects what runs
(ZeRO stage, precision, offload, ZeRO++, activation checkpointing, the profiler and timers):

    minispeed run --nproc_per_node 2 examples/tutorials/train.py \\
        --deepspeed_config examples/tutorials/configs/zero2_bf16.json --steps 20

Rank 0 prints one line per optimizer step (loss averaged over ranks, learning rate, gradient norm
before clipping, time) and at the end the peak resident memory of each rank. With `--check`, the
same steps are replayed in plain PyTorch on the full batch (rank 0) and the largest loss
difference is printed: the engine must train what PyTorch trains.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

import minispeed.comm as comm
import minispeed.engine as deepspeed  # a DeepSpeed script changes this line only

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/gpt.py, data.py
from data import CharDataset
from gpt import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--check", action="store_true", help="replay the steps in plain PyTorch")
    p.add_argument(
        "--checkpoint-blocks",
        action="store_true",
        help="recompute each block in backward (deepspeed.checkpointing.checkpoint)",
    )
    p.add_argument("--local_rank", type=int, default=-1, help="set by launchers; unused")
    p = deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    return p.parse_args()


def build_model(dataset: CharDataset, args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)  # the same weights on every rank
    cfg = GPTConfig(
        vocab_size=dataset.tokenizer.vocab_size,
        block_size=32,
        n_layer=args.n_layer,
        n_head=4,
        n_embd=args.n_embd,
        dropout=0.0,
    )
    return GPT(cfg)


def _checkpointed(forward):
    return lambda x: deepspeed.checkpointing.checkpoint(forward, x)


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    dataset = CharDataset.from_file()
    model = build_model(dataset, args)
    if args.checkpoint_blocks:
        for block in model.blocks:
            # What a DeepSpeed model does: the block's forward goes through checkpoint(), which
            # keeps its input only (on the host with cpu_checkpointing) and recomputes it later.
            block.forward = _checkpointed(block.forward)
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    if rank == 0:
        print(
            f"{model.num_params():,} parameters | {world} ranks | ZeRO stage "
            f"{engine.zero_optimization_stage()} | micro-batch {micro} x {gas} accumulation "
            f"x {world} ranks = {engine.train_batch_size()} sequences per step",
            flush=True,
        )
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        total = 0.0
        for m in range(gas):
            x, y = dataset.batch("train", step * gas + m, micro * world, 32, 0, rank, world)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        mean = torch.tensor([total])
        comm.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            norm = engine.get_global_grad_norm()
            norm_s = f"{norm:.3f}" if norm is not None else "-"
            print(
                f"step {step + 1:>3}  loss {losses[-1]:.4f}  lr {engine.get_lr()[0]:.2e}  "
                f"grad norm {norm_s}  {1e3 * (time.perf_counter() - t0):6.1f} ms",
                flush=True,
            )
    if engine.comms_logger is not None and rank == 0:  # config comms_logger.enabled
        engine.comms_logger.summary()  # DeepSpeed's script calls deepspeed.comm.log_summary()
    peaks = comm.all_gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rank == 0:
        print("peak resident memory per rank (MiB): " + ", ".join(f"{p:.0f}" for p in peaks))
    if args.check and rank == 0:
        print(f"largest |loss - plain PyTorch loss|: {_replay(args, dataset, losses, world):.2e}")
    comm.barrier()


def _replay(args: argparse.Namespace, dataset: CharDataset, losses: list, world: int) -> float:
    """The same steps in plain PyTorch on the full global batch: AdamW with the config's
    parameters, clipping by the config's norm; returns the largest loss difference."""
    import json

    ds = json.loads(Path(args.deepspeed_config).read_text())
    model = build_model(dataset, args)
    params = ds["optimizer"]["params"]
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=params["lr"],
        betas=tuple(params.get("betas", (0.9, 0.999))),
        weight_decay=params.get("weight_decay", 0.01),
    )
    micro = ds["train_micro_batch_size_per_gpu"]
    gas = ds.get("gradient_accumulation_steps", 1)
    clip = ds.get("gradient_clipping", 1.0)
    worst = 0.0
    for step, got in enumerate(losses):
        total = 0.0
        for m in range(gas):
            x, y = dataset.batch("train", step * gas + m, micro * world, 32, 0, 0, 1)
            _, loss = model(x, y)
            (loss / gas).backward()
            total += loss.item() / gas
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        worst = max(worst, abs(total - got))
    return worst


if __name__ == "__main__":
    main()
