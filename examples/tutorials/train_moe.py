"""The tutorials' GPT with mixture-of-experts feed-forward layers, written against DeepSpeed's API.

Each block's MLP becomes `MoE(hidden_size, expert=MLP, num_experts=4, ep_size=2, k=1)`: every
rank holds 4 / ep_size experts and tokens travel to their expert's rank by all-to-all. The
optimizer's groups come from `split_params_into_different_moe_groups_for_optimizer`, so that
`initialize` reduces and partitions the experts over their expert-data group and the rest over
the data group:

    minispeed run --nproc_per_node 2 examples/tutorials/train_moe.py \\
        --deepspeed_config examples/tutorials/configs/moe_zero2.json --steps 10

Rank 0 prints per step the language-model loss, the load-balancing loss `l_aux` (added with
weight 0.01), how many tokens each of block 0's experts took, and the parameters this rank holds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

import minispeed.comm as comm
import minispeed.engine as deepspeed  # a DeepSpeed script changes this line only
from minispeed.engine.moe.layer import MoE
from minispeed.engine.moe.utils import split_params_into_different_moe_groups_for_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/gpt.py, data.py
from data import CharDataset
from gpt import GPT, MLP, GPTConfig

EXPERTS, EP_SIZE, AUX_WEIGHT = 4, 2, 0.01


class MoEMLP(nn.Module):
    """A block's MLP as a mixture of experts; keeps the layer's `l_aux` and `exp_counts`."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.moe = MoE(
            hidden_size=cfg.n_embd,
            expert=MLP(cfg),
            num_experts=EXPERTS,
            ep_size=EP_SIZE,
            k=1,
            capacity_factor=2.0,
        )
        self.l_aux = torch.zeros(())
        self.exp_counts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, self.exp_counts = self.moe(x)
        return out


class MoEGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gpt = GPT(cfg)
        for block in self.gpt.blocks:
            block.mlp = MoEMLP(cfg)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, loss = self.gpt(x, y)
        aux = sum(block.mlp.l_aux for block in self.gpt.blocks)
        return loss + AUX_WEIGHT * aux, loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--local_rank", type=int, default=-1, help="set by launchers; unused")
    args = deepspeed.add_config_arguments(p).parse_args()
    deepspeed.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    dataset = CharDataset.from_file()
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=dataset.tokenizer.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64
    )
    model = MoEGPT(cfg)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "params"}
    )
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=groups)
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    experts = sum(p.numel() for g in groups if g.get("moe") for p in g["params"])
    dense = sum(p.numel() for g in groups if not g.get("moe") for p in g["params"])
    if rank == 0:
        print(
            f"{world} ranks, ep_size {EP_SIZE}: this rank holds {EXPERTS // EP_SIZE} of "
            f"{EXPERTS} experts per block ({experts:,} expert and {dense:,} dense parameters) | "
            f"ZeRO stage {engine.zero_optimization_stage()}",
            flush=True,
        )
    for step in range(args.steps):
        t0 = time.perf_counter()
        lm = aux = 0.0
        for m in range(gas):
            x, y = dataset.batch("train", step * gas + m, micro * world, 32, 0, rank, world)
            loss, lm_loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            lm += lm_loss.item() / gas
            aux += sum(b.mlp.l_aux.item() for b in model.gpt.blocks) / gas
        mean = torch.tensor([lm])
        comm.all_reduce(mean)
        counts = model.gpt.blocks[0].mlp.exp_counts
        if rank == 0:
            print(
                f"step {step + 1:>3}  loss {mean.item() / world:.4f}  l_aux {aux:.3f}  "
                f"block 0 tokens per expert {counts.tolist()}  "
                f"{1e3 * (time.perf_counter() - t0):6.1f} ms",
                flush=True,
            )
    comm.barrier()


if __name__ == "__main__":
    main()
