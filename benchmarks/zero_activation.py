"""Activation memory with and without ``zero.checkpoint``, on a small GPT (same run, same data).

Run::

    .venv/bin/python benchmarks/zero_activation.py            # defaults below
    .venv/bin/python benchmarks/zero_activation.py --layers 8 --seq 256

What is measured, per configuration (plain autograd / every block checkpointed):

- *saved bytes*: distinct storages autograd keeps for backward, counted with
  ``torch.autograd.graph.saved_tensors_hooks`` during the forward, parameters excluded; with
  checkpointing, the hooks see the tensors saved outside the blocks, and the inputs each
  ``zero.checkpoint`` call keeps are added (``S_in`` per block, activation.py);
- *live bytes after forward*: what the allocator still holds when the forward returns, minus the
  loss (CPU: torch.profiler memory events; GPU: ``memory_allocated``), an independent check;
- forward+backward time (median of ``--repeats``): the price, one extra forward per block;
- the gradients of both runs are compared exactly (they must be equal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

from minispeed.core.accelerator import get_accelerator
from minispeed.zero.activation import checkpoint


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int, width: int, heads: int, layers: int, seq: int, dropout: float
    ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor, ckpt: bool, kept: list
    ) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=idx.device), diagonal=1)
        for block in self.blocks:
            if ckpt:
                kept.extend([x, mask])  # what zero.checkpoint keeps for this block
                x = checkpoint(block, x, mask)
            else:
                x = block(x, mask)
        logits = self.ln_f(x) @ self.wte.weight.t()  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _storage_bytes(tensors, exclude: set[int]) -> int:
    sizes = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            sizes[s.data_ptr()] = s.nbytes()
    return sum(sizes.values())


def saved_bytes(model: GPT, batch, ckpt: bool) -> int:
    """Bytes autograd keeps for backward (parameters excluded), plus checkpoint inputs."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, kept = [], []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(*batch, ckpt=ckpt, kept=kept)
    total = _storage_bytes(saved + kept, params)
    loss.backward()
    return total


def live_bytes_after_forward(model: GPT, batch, ckpt: bool) -> int:
    """Allocator bytes still held when the forward returns (the activations), loss excluded."""
    acc = get_accelerator()
    if acc.name != "cpu":
        acc.synchronize()
        before = acc.memory_allocated()
        loss = model(*batch, ckpt=ckpt, kept=[])
        acc.synchronize()
        live = acc.memory_allocated() - before
    else:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = model(*batch, ckpt=ckpt, kept=[])
        live = sum(e.self_cpu_memory_usage for e in prof.events())
    live -= loss.untyped_storage().nbytes()
    loss.backward()
    return live


def step_seconds(model: GPT, batch, ckpt: bool, repeats: int) -> float:
    acc = get_accelerator()
    times = []
    for _ in range(repeats):
        acc.synchronize()
        t0 = time.perf_counter()
        model(*batch, ckpt=ckpt, kept=[]).backward()
        acc.synchronize()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def grads_after(model: GPT, batch, ckpt: bool, seed: int) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in both runs
    model(*batch, ckpt=ckpt, kept=[]).backward()
    return [p.grad.clone() for p in model.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    device = get_accelerator().device()
    model = GPT(args.vocab, args.width, args.heads, args.layers, args.seq, args.dropout).to(device)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    batch = (data[:, :-1], data[:, 1:])

    exact = all(
        torch.equal(a, b)
        for a, b in zip(grads_after(model, batch, False, 7), grads_after(model, batch, True, 7))
    )
    rows = {}
    for name, ckpt in (("plain autograd", False), ("zero.checkpoint per block", True)):
        model.zero_grad(set_to_none=True)
        rows[name] = (
            saved_bytes(model, batch, ckpt),
            live_bytes_after_forward(model, batch, ckpt),
            step_seconds(model, batch, ckpt, args.repeats),
        )
    plain, ck = rows["plain autograd"], rows["zero.checkpoint per block"]

    table = Table(
        title=(
            f"activation memory, GPT {args.layers}x{args.width} (heads {args.heads}), batch "
            f"{args.batch}x{args.seq}, dropout {args.dropout}, on {get_accelerator().name}"
        )
    )
    for col in ("", "saved bytes", "live bytes after forward", "fwd+bwd s"):
        table.add_column(col, justify="right")
    for name, (s, live, sec) in rows.items():
        table.add_row(name, f"{s:,}", f"{live:,}", f"{sec:.3f}")
    table.add_row(
        "ratio (checkpoint / plain)",
        f"{ck[0] / plain[0]:.3f}",
        f"{ck[1] / plain[1]:.3f}",
        f"{ck[2] / plain[2]:.2f}",
    )
    Console().print(table)
    print(f"gradients equal exactly: {exact}")
    print(
        json.dumps(
            {
                "benchmark": "zero_activation",
                "args": vars(args),
                "device": get_accelerator().name,
                "saved_bytes": {"plain": plain[0], "checkpoint": ck[0]},
                "live_bytes_after_forward": {"plain": plain[1], "checkpoint": ck[1]},
                "step_seconds": {"plain": plain[2], "checkpoint": ck[2]},
                "gradients_equal": exact,
            }
        )
    )


if __name__ == "__main__":
    main()
