"""What minispeed.compression's fake quantization costs a linear layer's forward + backward on
the CPU, as ratios to the plain layer in the same run (docs/packages/compression.md).

    .venv/bin/python benchmarks/compression_overhead.py
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from minispeed import compression

WIDTH, TOKENS, REPEATS = 1024, 256, 30


def _time(layer: nn.Module, x: torch.Tensor) -> float:
    """The fastest of `REPEATS` forward + backward passes (the least disturbed by other load)."""
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        layer(x).sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(TOKENS, WIDTH)
    plain = nn.Linear(WIDTH, WIDTH)
    cases = {
        "weights 8-bit (1 group)": dict(weight=(8, 1)),
        "weights 8-bit (64 groups)": dict(weight=(8, 64)),
        "activations 8-bit dynamic": dict(act=False),
        "sparse l1 mask (dense 0.5)": dict(sparse=True),
    }
    base = _time(plain, x)
    print(f"load: {os.getloadavg()[0]:.2f}; plain Linear({WIDTH}, {WIDTH}) on {TOKENS} tokens, "
          f"forward+backward: {base * 1e3:.2f} ms")  # fmt: skip
    for name, spec in cases.items():
        layer = compression.CompressedLinear.wrap(nn.Linear(WIDTH, WIDTH))
        if "weight" in spec:
            layer.enable_weight_quantization(*spec["weight"], symmetric=True)
            layer.weight_active = True
        if "act" in spec:
            layer.enable_activation_quantization(8, symmetric=True, static=spec["act"])
            layer.activation_active = True
        if "sparse" in spec:
            layer.enable_sparse_pruning(0.5, "l1")
            assert layer.sparse is not None
            layer.sparse.active = True
        # the plain layer timed again beside each case: the ratio of the two fastest passes
        print(f"{name:28s} x{_time(layer, x) / min(base, _time(plain, x)):.2f}")


if __name__ == "__main__":
    main()
