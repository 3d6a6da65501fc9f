"""Shared by the engine's tensor-parallel tests: minispeed's GPT (examples/gpt.py) at toy size,
each data replica's micro-batches, and the one-process PyTorch reference on the same global
batch (every replica's micro-batches, gradients averaged, clipped by the whole model's norm)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
B, T, C, H, L, V = 2, 8, 16, 2, 2, 32  # micro-batch, sequence, width, heads, blocks, vocabulary


def gpt_module():
    """examples/gpt.py as a module (the examples are not a package)."""
    if "minispeed_example_gpt" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "minispeed_example_gpt", REPO / "examples/gpt.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["minispeed_example_gpt"] = module
        spec.loader.exec_module(module)
    return sys.modules["minispeed_example_gpt"]


def gpt(seed: int = 0, n_layer: int = L):
    """The unsplit GPT, built under `seed`."""
    g = gpt_module()
    torch.manual_seed(seed)
    return g.GPT(g.GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=H, n_embd=C))


def micro_batches(replica: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replica `replica`'s `count` micro-batches of (ids, targets), each (B, T)."""
    g = torch.Generator().manual_seed(100 + replica)
    return [
        (torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))
        for _ in range(count)
    ]


def reference(steps: int, replicas: int, gas: int, clip: float, lr: float, n_layer: int = L):
    """Per step: each replica's micro-batch losses, and the gradient norm before clipping, of
    one process training the unsplit GPT with SGD on the same global batch. (SGD, not Adam:
    Adam's first steps move every element by about lr·sign(g), so elements whose gradient is
    rounding noise, 1e-9 here or there, would decide the comparison.)"""
    model = gpt(n_layer=n_layer)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = [micro_batches(r, steps * gas) for r in range(replicas)]
    losses, norms = [], []
    for step in range(steps):
        per = []
        for r in range(replicas):
            for m in range(gas):
                x, y = data[r][step * gas + m]
                logits, _ = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                (loss / (replicas * gas)).backward()
                per.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        losses.append(per)
    return losses, norms


def evaluate(model, batches, group=None) -> float:
    """Mean loss over `batches` without gradients (vocabulary-parallel when `group` is given)."""
    import minispeed.tensor_parallel as tp

    total = 0.0
    with torch.no_grad():
        for x, y in batches:
            logits, _ = model(x)
            if group is None:
                total += F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
            else:
                total += tp.vocab_parallel_cross_entropy(logits, y, group).item()
    return total / len(batches)
