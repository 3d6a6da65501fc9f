"""The tutorials' GPT as a two-stage pipeline, written against DeepSpeed's pipeline API.

`PipelineModule` of `LayerSpec`s with the embedding and the output head tied (`TiedLayerSpec`),
`initialize`, then `engine.train_batch(data_iter)`, which pulls the step's micro-batches itself:

    minispeed run --nproc_per_node 2 examples/tutorials/train_pipe.py \\
        --deepspeed_config examples/tutorials/configs/pipe_zero1.json --steps 10 --check

On N processes the stages take N / 2 data-parallel replicas each (4 processes: 2 stages x 2).
Rank 0 prints the loss per step (`train_batch` returns it on every stage) and, with `--check`,
replays the steps in plain PyTorch (the same layers built under the same per-layer seeds, the
full global batch, `clip_grad_norm_` over the whole model) and prints the largest difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import minispeed.comm as comm
import minispeed.engine as deepspeed  # a DeepSpeed script changes this line only
from minispeed.engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/gpt.py, data.py
from data import CharDataset
from gpt import Block, GPTConfig

SEQ, BASE_SEED = 32, 1234


class Embed(nn.Module):
    """Token and position embeddings; `weight` (the token table) is also the output head's."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.02)
        self.pos = nn.Embedding(SEQ, dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight) + self.pos(torch.arange(idx.shape[1]))


def head(embed: Embed, h: torch.Tensor) -> torch.Tensor:
    """The tied output projection: logits = h · Eᵀ."""
    return h @ embed.weight.t()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def layer_specs(vocab: int, cfg: GPTConfig) -> list:
    return [
        TiedLayerSpec("embed", Embed, vocab, cfg.n_embd),
        *[LayerSpec(Block, cfg) for _ in range(cfg.n_layer)],
        LayerSpec(nn.LayerNorm, cfg.n_embd),
        TiedLayerSpec("embed", Embed, vocab, cfg.n_embd, forward_fn=head),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--check", action="store_true", help="replay the steps in plain PyTorch")
    p.add_argument("--local_rank", type=int, default=-1, help="set by launchers; unused")
    args = deepspeed.add_config_arguments(p).parse_args()
    deepspeed.init_distributed()
    rank = comm.get_rank()
    dataset = CharDataset.from_file()
    vocab = dataset.tokenizer.vocab_size
    cfg = GPTConfig(vocab_size=vocab, block_size=SEQ, n_layer=4, n_head=4, n_embd=64)
    model = PipelineModule(
        layers=layer_specs(vocab, cfg),
        num_stages=2,
        loss_fn=lm_loss,
        seed_layers=True,  # layer i is built under BASE_SEED + i, whatever the partition
        base_seed=BASE_SEED,
        partition_method="uniform",
    )
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters()
    )
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dp = engine.dp_world_size
    dp_rank = rank % dp  # the grid is (pipe, data), data fastest, in DeepSpeed and here
    if rank == 0:
        print(
            f"stage {engine.stage_id} of {engine.num_stages} | {dp} data-parallel replica(s) | "
            f"{gas} micro-batches of {micro} per step | ZeRO stage "
            f"{engine.zero_optimization_stage()}",
            flush=True,
        )

    def batches(step: int):  # this replica's share of the step's micro-batches
        for m in range(gas):
            yield dataset.batch("train", step * gas + m, micro * dp, SEQ, 0, dp_rank, dp)

    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        losses.append(float(engine.train_batch(batches(step))))
        if rank == 0:
            norm = engine.get_global_grad_norm()
            print(
                f"step {step + 1:>3}  loss {losses[-1]:.4f}  grad norm "
                f"{'-' if norm is None else f'{norm:.3f}'}  "
                f"{1e3 * (time.perf_counter() - t0):6.1f} ms",
                flush=True,
            )
    if args.check and rank == 0:
        worst = _replay(args, dataset, cfg, losses, micro * dp, gas)
        print(f"largest |loss - plain PyTorch loss|: {worst:.2e}")
    comm.barrier()


def _replay(args, dataset, cfg: GPTConfig, losses: list, batch: int, gas: int) -> float:
    """The same model unsplit, each layer built under the seed the pipeline used."""
    layers: list[nn.Module] = []
    for i, spec in enumerate(layer_specs(cfg.vocab_size, cfg)[:-1]):
        torch.manual_seed(BASE_SEED + i)
        layers.append(spec.build())
    embed, body = layers[0], nn.Sequential(*layers[1:])
    params = [*embed.parameters(), *body.parameters()]
    ds = json.loads(Path(args.deepspeed_config).read_text())
    hp = ds["optimizer"]["params"]
    opt = torch.optim.AdamW(params, lr=hp["lr"], betas=tuple(hp["betas"]), weight_decay=0.01)
    worst = 0.0
    for step, got in enumerate(losses):
        total = 0.0
        for m in range(gas):
            x, y = dataset.batch("train", step * gas + m, batch, SEQ, 0, 0, 1)
            loss = lm_loss(head(embed, body(embed(x))), y)
            (loss / gas).backward()
            total += loss.item() / gas
        torch.nn.utils.clip_grad_norm_(params, ds.get("gradient_clipping", 1.0))
        opt.step()
        opt.zero_grad()
        worst = max(worst, abs(total - got))
    return worst


if __name__ == "__main__":
    main()
