"""Bytes autograd keeps from forward to backward for a gated MLP and for the output head plus
cross-entropy, untiled and with `minispeed.tensor_parallel`'s sequence tiling (16 tiles), at
B = 1, T = 4096, d = 256, I = 688, V = 32000 (docs/packages/tensor_parallel.md, "Sequence
tiling"). Counted with `torch.autograd.graph.saved_tensors_hooks` (each storage once, the
weights left out); the transient bytes of the one tile being computed are not kept and not
counted.

    .venv/bin/python benchmarks/alst_tiling_memory.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minispeed.tensor_parallel import TiledLogitsLoss, TiledMLP

B, T, D, INNER, V, TILES = 1, 4096, 256, 688, 32000, 16


class GatedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, INNER, bias=False)
        self.up = nn.Linear(D, INNER, bias=False)
        self.down = nn.Linear(INNER, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def saved_bytes(fn: Callable[[], object], weights: nn.Module) -> int:
    """Bytes of the tensors autograd saves while `fn()` runs, each storage once, less
    `weights`'s parameters."""
    seen: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in weights.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def head_loss(head: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(x).float(), y, reduction="sum")


def main() -> None:
    torch.manual_seed(0)
    mlp, x = GatedMLP(), torch.randn(B, T, D, requires_grad=True)
    head, y = nn.Linear(D, V, bias=False), torch.randint(0, V, (B, T))
    rows = [
        ("gated MLP", saved_bytes(lambda: mlp(x), mlp),
         saved_bytes(lambda: TiledMLP.apply(lambda m, t: m(t), mlp, x, TILES, None), mlp)),
        ("head + loss", saved_bytes(lambda: head_loss(head, x.view(-1, D), y.view(-1)), head),
         saved_bytes(lambda: TiledLogitsLoss.apply(head_loss, head, x, y, None, TILES, None,
                                                   "sum"), head)),
    ]  # fmt: skip
    print(f"B={B} T={T} d={D} I={INNER} V={V}, {TILES} tiles; bytes kept for backward")
    for name, untiled, tiled in rows:
        print(f"{name:12s} untiled {untiled:>13,d}  tiled {tiled:>11,d}  ({untiled / tiled:.1f}x)")


if __name__ == "__main__":
    main()
