"""Block-sparse attention (minispeed.inference.sparse) against dense attention, time and memory.

Run from the repository root:

    .venv/bin/python benchmarks/inference_sparse_attention.py                 # T = 1k, 2k, 4k, 8k
    .venv/bin/python benchmarks/inference_sparse_attention.py --seq-lens 1024 # one quick point

For each sequence length T, on the same q, k, v `(batch, heads, T, dim)` fp32 CPU tensors:

- `sdpa+mask`: `F.scaled_dot_product_attention` with the layout's expanded bool mask `(H, T, T)`
  (its cost does not depend on which tiles the mask keeps, so it is timed once per T, with the
  BigBird mask; the mask's bytes are listed apart, `H T²`);
- `sdpa`: SDPA without a mask (`is_causal=True` for the causal layouts' baseline, `sdpa-causal`);
- one row per layout: the C++ block-sparse op (`block_sparse_attention`), with its density
  (kept tiles / all tiles).

Columns: forward time (`fwd`, no grad), forward + backward time (`fwd+bwd`), and the peak
resident memory the fwd+bwd call adds above what the inputs already hold (`peak MiB`: Linux
VmHWM after resetting it through /proc/self/clear_refs; the script re-runs itself with
`MALLOC_MMAP_THRESHOLD_=65536`, so every buffer of 64 KiB or more is mapped on allocation and
returned on free instead of being recycled inside the heap). Times are the best of `--rounds`.
Ratios (`x`) are the dense baseline's time over the op's, from the same run: over `sdpa+mask`
and over the unmasked SDPA of the same direction.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from timing import best_time

from minispeed.inference.sparse import (
    BigBirdSparsityConfig,
    BlockSparseLayout,
    BSLongformerSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    VariableSparsityConfig,
    block_sparse_attention,
    expand_layout,
)
from minispeed.inference.sparse.attention import _load_sparse_op


def _layouts(heads: int, block: int) -> dict[str, object]:
    return {
        "local (w3, causal)": LocalSlidingWindowSparsityConfig(heads, block),
        "fixed (l4 g1, causal)": FixedSparsityConfig(
            heads, block, num_local_blocks=4, attention="unidirectional"
        ),
        "variable (l4 r2 g[0], causal)": VariableSparsityConfig(
            heads, block, True, num_random_blocks=2, attention="unidirectional"
        ),
        "bigbird (w3 r1 g1)": BigBirdSparsityConfig(heads, block, True),
        "bslongformer (w3 g[0])": BSLongformerSparsityConfig(heads, block),
    }


def _peak_rss_mib(fn) -> float:
    """Peak resident memory `fn()` adds, MiB (Linux: reset VmHWM, run, read it back)."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return float("nan")
    base = status("VmRSS:")
    fn()
    return (status("VmHWM:") - base) / 1024


def _measure(attend, q, k, v, rounds: int) -> tuple[float, float, float]:
    """(fwd seconds, fwd+bwd seconds, peak MiB of fwd+bwd) of `attend(q, k, v)`."""
    grad_out = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            attend(q, k, v)

    def fwd_bwd():
        torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out)

    fwd_bwd()  # warm-up (and the op's layout/threads)
    peak = _peak_rss_mib(fwd_bwd)
    return best_time(fwd, rounds), best_time(fwd_bwd, rounds), peak


def bench(seq: int, args) -> list[str]:
    gen = torch.Generator().manual_seed(seq)
    shape = (args.batch, args.heads, seq, args.dim)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(3))
    layouts = _layouts(args.heads, args.block)
    csrs = {
        name: BlockSparseLayout.from_layout(cfg.make_layout(seq), args.block, causal=cfg.causal)
        for name, cfg in layouts.items()
    }
    mask = expand_layout(csrs["bigbird (w3 r1 g1)"].layout, args.block)  # (H, T, T) bool
    base = {
        "sdpa+mask": _measure(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), q, k, v,
            args.rounds,
        ),
        "sdpa": _measure(F.scaled_dot_product_attention, q, k, v, args.rounds),
        "sdpa-causal": _measure(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v,
            args.rounds,
        ),
    }  # fmt: skip
    rows = []
    for name, (fw, fb, peak) in base.items():
        rows.append(
            f"| {seq} | {name} | 1.000 | {fw * 1e3:.1f} | {fb * 1e3:.1f} | {peak:.0f} | - | - |"
        )
    for name, csr in csrs.items():
        fw, fb, peak = _measure(
            lambda q, k, v, csr=csr: block_sparse_attention(q, k, v, csr), q, k, v, args.rounds
        )
        plain = base["sdpa-causal" if csr.causal else "sdpa"]
        rows.append(
            f"| {seq} | {name} | {csr.density:.3f} | {fw * 1e3:.1f} | {fb * 1e3:.1f} | {peak:.0f} "
            f"| {base['sdpa+mask'][0] / fw:.2f} / {base['sdpa+mask'][1] / fb:.2f} "
            f"| {plain[0] / fw:.2f} / {plain[1] / fb:.2f} |"
        )
    mask_mib = mask.numel() / 2**20
    rows.append(f"| {seq} | (the mask itself) | | | | {mask_mib:.0f} | | |")
    return rows


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # see the module docstring: honest peaks
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if _load_sparse_op() is None:
        raise SystemExit("the inference_kernels op could not be built: see minispeed.core.report")
    load = os.getloadavg()[0]
    print(
        f"batch {args.batch}, heads {args.heads}, head dim {args.dim}, block {args.block}, "
        f"fp32, torch threads {torch.get_num_threads()}, load average {load:.1f} on "
        f"{os.cpu_count()} CPUs"
    )
    print(
        "| T | attention | density | fwd ms | fwd+bwd ms | peak MiB (fwd+bwd) "
        "| x over sdpa+mask (fwd / fwd+bwd) | x over sdpa, same direction (fwd / fwd+bwd) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for seq in args.seq_lens:
        for row in bench(seq, args):
            print(row, flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
