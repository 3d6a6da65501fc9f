"""Block-sparse attention (minispeed.inference.sparse) against dense attention, time and memory.

Run from the repository root:

    .venv/bin/python benchmarks/inference_sparse_attention.py --threads 1     # T = 4k and 16k
    .venv/bin/python benchmarks/inference_sparse_attention.py --seq-lens 1024 # one quick point

For each sequence length T, on the same q, k, v `(batch, heads, T, dim)` fp32 CPU tensors:

- `sdpa+mask`: `F.scaled_dot_product_attention` with the layout's expanded bool mask `(H, T, T)`
  (its cost does not depend on which tiles the mask keeps, so it is timed once per T, with the
  BigBird mask; the mask's bytes are listed apart, `H T²`);
- `sdpa`: SDPA without a mask (`is_causal=True` for the causal layouts' baseline, `sdpa-causal`);
- one row per layout: the C++ block-sparse op (`block_sparse_attention`), with its density
  (kept tiles / all tiles).

`--clock cpu` times with the process's CPU time instead of wall time: on a machine other jobs
load, wall time counts the turns the scheduler gives them, CPU time only this process's work
(with `--threads 1` that is the op's or SDPA's own).

Columns: forward time (`fwd`, no grad), forward + backward time (`fwd+bwd`), each the median of
`--rounds` rounds in which every contender takes its turn (order reversed every other round), and
the peak resident memory the fwd+bwd call adds above what the inputs already hold (`peak MiB`:
Linux VmHWM after resetting it through /proc/self/clear_refs, in a child process started with
`MALLOC_MMAP_THRESHOLD_=65536`, so every buffer of 64 KiB or more is mapped on allocation and
returned on free instead of being recycled inside the heap; the times come from this process,
with the allocator as users run it). Ratios (`x`) are the dense baseline's time over the op's,
from the same run: over `sdpa+mask` and over the unmasked SDPA of the same direction. The last
column divides the op's time per computed score (`computed_scores`) by the same-direction SDPA's,
per round, forward, backward (a round's fwd+bwd less its forward) and both: its median and
[min–max].

`--before DIR` compares two builds of the op instead: DIR is a copy of an earlier
`minispeed/inference/csrc` (for example `git archive <commit>` of it), built as its own `.so`;
both builds take turns with SDPA in the same rounds, every layout, after their outputs and
gradients are asserted bit-equal (or the script stops), and every call comes after a 512 MiB
write, so q, k, v and out come from DRAM, as after the masked SDPA of the main table. The table
gives each build's time per computed score over SDPA's and the median of the per-round ratio
after / before, forward and backward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minispeed.inference.kernels import InferenceKernelsBuilder
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
from minispeed.inference.sparse.attention import BlockSparseAttentionFunction, _load_sparse_op


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


def computed_scores(csr: BlockSparseLayout | None, seq: int, heads: int, causal: bool) -> int:
    """(query, key) pairs whose score attention computes, per batch element: every kept tile's
    `b²`, `b (b + 1) / 2` on a causal diagonal tile; dense (`csr` None): `H T²`, causal
    `H T (T + 1) / 2`."""
    if csr is None:
        return heads * (seq * (seq + 1) // 2 if causal else seq * seq)
    b = csr.block
    kept = torch.tril(csr.layout) if causal else csr.layout
    diagonal = int(kept.diagonal(dim1=1, dim2=2).sum()) if causal else 0
    return (int(kept.sum()) - diagonal) * b * b + diagonal * b * (b + 1) // 2


def _backward(rounds: tuple[list[float], list[float]]) -> list[float]:
    """Backward seconds per round: the round's fwd+bwd less its forward (timed apart, no grad)."""
    return [fb - f for f, fb in zip(*rounds)]


def _ratio_cell(ratios: list[float]) -> str:
    """The median of per-round ratios and their spread: `1.23 [1.10–1.40]`."""
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}]"


def _rounds(
    contenders: dict, q, k, v, rounds: int, clock=time.perf_counter, before_each=lambda: None
) -> dict[str, tuple[list[float], list[float]]]:
    """`{name: (fwd seconds per round, fwd+bwd seconds per round)}`, the contenders taking turns
    in every round (order reversed every other round) after one warm-up call each; `clock` is
    wall time, or `time.process_time` (CPU time of every thread of this process); `before_each`
    runs untimed before every timed call."""
    grad_out = torch.randn_like(q)

    def fwd(attend):
        with torch.no_grad():
            attend(q, k, v)

    def fwd_bwd(attend):
        torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out)

    times = {name: ([], []) for name in contenders}
    for attend in contenders.values():
        fwd_bwd(attend)  # warm-up (and the op's layout/threads)
    for r in range(rounds):
        names = list(contenders)[:: 1 if r % 2 == 0 else -1]
        for name in names:
            for run, out in ((fwd, times[name][0]), (fwd_bwd, times[name][1])):
                before_each()
                start = clock()
                run(contenders[name])
                out.append(clock() - start)
    return times


def _setup(seq: int, args):
    """The inputs, the layouts' CSRs, the BigBird mask and every contender, for one T."""
    gen = torch.Generator().manual_seed(seq)
    shape = (args.batch, args.heads, seq, args.dim)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_() for _ in range(3))
    layouts = _layouts(args.heads, args.block)
    csrs = {
        name: BlockSparseLayout.from_layout(cfg.make_layout(seq), args.block, causal=cfg.causal)
        for name, cfg in layouts.items()
    }
    mask = expand_layout(csrs["bigbird (w3 r1 g1)"].layout, args.block)  # (H, T, T) bool
    contenders = {
        "sdpa": F.scaled_dot_product_attention,
        "sdpa-causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    if seq <= args.mask_max_seq:  # its (H, T, T) scores and probabilities: 8 H T² bytes
        contenders["sdpa+mask"] = lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask
        )
    for name, csr in csrs.items():
        contenders[name] = lambda q, k, v, csr=csr: block_sparse_attention(q, k, v, csr)
    return (q, k, v), csrs, mask, contenders


def peaks(seq: int, args) -> dict[str, float]:
    """Each contender's fwd+bwd peak MiB, measured in a child process started with
    `MALLOC_MMAP_THRESHOLD_=65536` (see the module docstring), after one warm-up call each."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    argv = [sys.executable, __file__, *sys.argv[1:], "--peaks-for", str(seq)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _print_peaks(seq: int, args) -> None:
    (q, k, v), _, _, contenders = _setup(seq, args)
    result = {}
    for name, fn in contenders.items():

        def fwd_bwd(fn=fn):
            torch.autograd.grad(fn(q, k, v), (q, k, v), torch.ones_like(q))

        fwd_bwd()  # warm-up
        result[name] = _peak_rss_mib(fwd_bwd)
    print(json.dumps(result))


def bench(seq: int, args) -> list[str]:
    (q, k, v), csrs, mask, contenders = _setup(seq, args)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times = _rounds(contenders, q, k, v, args.rounds, clock)
    peak = peaks(seq, args)
    med = {name: (statistics.median(f), statistics.median(fb)) for name, (f, fb) in times.items()}
    rows = []
    for name in ("sdpa+mask", "sdpa", "sdpa-causal"):
        if name in med:
            fw, fb = med[name]
            rows.append(f"| {seq} | {name} | 1.000 | {fw * 1e3:.1f} | {fb * 1e3:.1f} "
                        f"| {peak[name]:.0f} | - | - | - |")  # fmt: skip
    for name, csr in csrs.items():
        plain = "sdpa-causal" if csr.causal else "sdpa"
        dense = computed_scores(None, seq, args.heads, csr.causal)
        ours = computed_scores(csr, seq, args.heads, csr.causal)

        ours_rounds = (times[name][0], _backward(times[name]), times[name][1])
        dense_rounds = (times[plain][0], _backward(times[plain]), times[plain][1])
        per_score = [
            _ratio_cell([(o / ours) / (d / dense) for o, d in zip(mine, base)])
            for mine, base in zip(ours_rounds, dense_rounds)
        ]  # op time per score over SDPA's, each round; fwd, bwd, fwd+bwd
        fw, fb = med[name]
        masked = (
            f"{med['sdpa+mask'][0] / fw:.2f} / {med['sdpa+mask'][1] / fb:.2f}"
            if "sdpa+mask" in med
            else "-"
        )
        rows.append(
            f"| {seq} | {name} | {csr.density:.3f} | {fw * 1e3:.1f} | {fb * 1e3:.1f} "
            f"| {peak[name]:.0f} | {masked} | {med[plain][0] / fw:.2f} / {med[plain][1] / fb:.2f} "
            f"| {per_score[0]} / {per_score[1]} / {per_score[2]} |"
        )
    rows.append(f"| {seq} | (the mask itself) | | | | {mask.numel() / 2**20:.0f} | | | |")
    return rows


def before_after(seq: int, args) -> list[str]:
    """Rows of the `--before` table for one T (see the module docstring)."""
    before = InferenceKernelsBuilder(csrc_root=Path(args.before)).load()
    after = _load_sparse_op()
    if before.__name__ == after.__name__:
        raise SystemExit(f"{args.before} holds this checkout's sources: nothing to compare")
    (q, k, v), csrs, _, _ = _setup(seq, args)
    scale = args.dim**-0.5
    contenders = {
        "sdpa": F.scaled_dot_product_attention,
        "sdpa-causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    grad_out = torch.randn_like(q)
    for name, csr in csrs.items():
        outputs = []
        for build, op in (("before", before), ("after", after)):
            attend = contenders[name, build] = lambda q, k, v, csr=csr, op=op: (
                BlockSparseAttentionFunction.apply(q, k, v, csr, op, scale)
            )
            out = attend(q, k, v)
            outputs.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
        if not all(torch.equal(a, b) for a, b in zip(*outputs)):
            raise SystemExit(f"{name}: the two builds' outputs or gradients differ")
    flush = torch.empty(128 * 2**20)  # 512 MiB, written before every timed call
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times = _rounds(contenders, q, k, v, args.rounds, clock, lambda: flush.fill_(1.0))
    rows = []
    for name, csr in csrs.items():
        dense = computed_scores(None, seq, args.heads, csr.causal)
        ours = computed_scores(csr, seq, args.heads, csr.causal)
        base = "sdpa-causal" if csr.causal else "sdpa"
        cells, speedups = [], []
        for pick in (lambda t: t[0], _backward):
            old, new, sdpa = (pick(times[key]) for key in ((name, "before"), (name, "after"), base))
            per = [statistics.median([(o / ours) / (d / dense) for o, d in zip(t, sdpa)])
                   for t in (old, new)]  # fmt: skip
            cells.append(f"{per[0]:.2f} → {per[1]:.2f}")
            speedups.append(f"{statistics.median([n / o for n, o in zip(new, old)]):.3f}")
        rows.append(f"| {seq} | {name} | {csr.density:.3f} | {' | '.join(cells)} "
                    f"| {'; '.join(speedups)} |")  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch and OpenMP threads for every contender")  # fmt: skip
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time, steadier than wall time on a loaded "
                        "machine (every thread counted; with --threads 1, the work itself)")  # fmt: skip
    parser.add_argument("--mask-max-seq", type=int, default=8192,
                        help="longest T timed with SDPA under the layout's mask (8 H T² bytes)")  # fmt: skip
    parser.add_argument(
        "--before", help="an earlier csrc directory: compare its build with this one"
    )
    parser.add_argument("--peaks-for", type=int, help=argparse.SUPPRESS)  # the child of peaks()
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.peaks_for is not None:
        _print_peaks(args.peaks_for, args)
        return
    if _load_sparse_op() is None:
        raise SystemExit("the inference_kernels op could not be built: see minispeed.core.report")
    load = os.getloadavg()[0]
    print(
        f"batch {args.batch}, heads {args.heads}, head dim {args.dim}, block {args.block}, "
        f"fp32, torch threads {torch.get_num_threads()}, {args.rounds} interleaved rounds "
        f"(medians, {args.clock} time), load average {load:.1f} on {os.cpu_count()} CPUs"
    )
    if args.before is not None:  # see the module docstring
        header = ("T", "attention", "density", "per score / sdpa's, fwd: before → after",
                  "bwd: before → after", "after / before (fwd; bwd)")  # fmt: skip
        table = before_after
    else:
        header = ("T", "attention", "density", "fwd ms", "fwd+bwd ms", "peak MiB (fwd+bwd)",
                  "x over sdpa+mask (fwd / fwd+bwd)", "x over sdpa, same direction (fwd / fwd+bwd)",
                  "time per computed score / sdpa's (fwd / bwd / fwd+bwd) [min–max]")  # fmt: skip
        table = bench
    print(f"| {' | '.join(header)} |")
    print("|" + "---|" * len(header))
    for seq in args.seq_lens:
        for row in table(seq, args):
            print(row, flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
