"""Training tokens/s of an MoE model against a dense model with the same active parameters.

Run: `.venv/bin/python benchmarks/moe_throughput.py [--steps 3] [--threads N]`

Both models are a stack of L residual blocks `x + mlp(layer_norm(x))` with MLP d → h → d. The
dense model's MLP has h = k·4d; the MoE model replaces each MLP by E experts of h = 4d with
top-k routing (capacity factor 1.25, dropping on), so a token meets the same number of MLP
weights in both (k·8d² per block) and the MoE holds E/k times as many. One step is forward,
backward (with the aux loss for the MoE) and an SGD update; both models run alternately in this
one process on the same batches, best step time of `--steps` after one warm-up.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import minispeed.moe as moe

SIZES = [  # (name, d, blocks L, experts E, k, tokens per step)
    ("small", 256, 2, 8, 1, 2048),
    ("large", 512, 4, 8, 1, 1024),
]


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _step_seconds(model: nn.Module, x: torch.Tensor, is_moe: bool) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    start = time.perf_counter()
    opt.zero_grad()
    loss = model(x).square().mean()
    if is_moe:
        loss = loss + moe.aux_loss(model)
    loss.backward()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads}")
    print("size  | params dense | params MoE (active) | dense tok/s | MoE tok/s | MoE/dense")
    for name, d, layers, e, k, tokens in SIZES:
        torch.manual_seed(0)
        dense = nn.Sequential(*[Block(d, k * 4 * d) for _ in range(layers)])
        sparse = nn.Sequential(*[Block(d, 4 * d) for _ in range(layers)])
        cfg = moe.MoEConfig(num_experts=e, top_k=k, capacity_factor=1.25)
        moe.replace_mlp(sparse, cfg)
        n_dense = sum(p.numel() for p in dense.parameters())
        n_moe = sum(p.numel() for p in sparse.parameters())
        n_active = n_moe - sum(p.numel() for p in moe.expert_parameters(sparse)) * (e - k) // e
        x = torch.randn(tokens, d)
        best = {"dense": float("inf"), "moe": float("inf")}
        for step in range(args.steps + 1):  # step 0 warms up
            for kind, model in (("dense", dense), ("moe", sparse)):
                t = _step_seconds(model, x, kind == "moe")
                if step:
                    best[kind] = min(best[kind], t)
        tps = {kind: tokens / t for kind, t in best.items()}
        print(
            f"{name:<5} | {n_dense / 1e6:9.2f} M  | {n_moe / 1e6:7.2f} M ({n_active / 1e6:.2f} M)  | "
            f"{tps['dense']:11.0f} | {tps['moe']:9.0f} | {tps['moe'] / tps['dense']:9.2f}"
        )


if __name__ == "__main__":
    main()
