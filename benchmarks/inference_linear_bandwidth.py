"""The decode linears' read rate at one row, against the core's own streaming rates.

Each kernel of a batch-1 decode step (`kernels.linear`, `linear_many`, `swiglu`) at the shapes of
the 124M LLaMA and GPT-2 of `inference_decode.py`, timed over several copies of its weights so
that they come from DRAM rather than the caches, against two references measured in the same
run on 256 MiB: `copy_` counted as STREAM counts it (bytes read + bytes written, the figure
`inference_decode.py`'s floor divides by) and a read-only pass (`sum`), the rate at which one
core can stream bytes it only reads. A kernel at the read-only rate reads its weights as fast
as this core can; the floor's copy rate is then out of its reach by their ratio. Asserts each
kernel's output against `F.linear` before it prints a rate.

    .venv/bin/python benchmarks/inference_linear_bandwidth.py [--threads 1] [--reps 30]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from timing import best_time

from minispeed.inference import kernels

COPIES = 8  # weight copies cycled through: 8 × the largest block weight is beyond the L3


def _median(fn, reps: int) -> float:
    times = []
    for r in range(reps):
        start = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    src = torch.randn(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    copy_rate = 2 * nbytes / best_time(lambda: dst.copy_(src), 10)
    read_rate = nbytes / best_time(src.sum, 10)
    print(f"{args.threads} thread(s): copy (read + written) {copy_rate / 1e9:.1f} GB/s, "
          f"read-only (sum) {read_rate / 1e9:.1f} GB/s\n")  # fmt: skip

    def weights(n: int, k: int, copies: int = COPIES) -> list[torch.Tensor]:
        return [torch.randn(n, k) / k**0.5 for _ in range(copies)]

    x768, x2048 = torch.randn(1, 768), torch.randn(1, 2048)
    q, k, v = weights(768, 768), weights(256, 768), weights(256, 768)
    o, gate, up = weights(768, 768), weights(2048, 768), weights(2048, 768)
    down, head, fc = weights(768, 2048), weights(32000, 768, 2), weights(3072, 768)
    cases = [
        ("LLaMA q, k, v (linear_many)", lambda i: kernels.linear_many(x768, [q[i], k[i], v[i]]),
         lambda i: [F.linear(x768, w[i]) for w in (q, k, v)], 1280 * 768),
        ("LLaMA o (linear)", lambda i: kernels.linear(x768, o[i]),
         lambda i: F.linear(x768, o[i]), 768 * 768),
        ("LLaMA gate, up (swiglu)", lambda i: kernels.swiglu(x768, gate[i], up[i]),
         lambda i: F.silu(F.linear(x768, gate[i])) * F.linear(x768, up[i]), 2 * 2048 * 768),
        ("LLaMA down (linear)", lambda i: kernels.linear(x2048, down[i]),
         lambda i: F.linear(x2048, down[i]), 768 * 2048),
        ("LLaMA head (linear)", lambda i: kernels.linear(x768, head[i % 2]),
         lambda i: F.linear(x768, head[i % 2]), 32000 * 768),
        ("GPT-2 fc (linear)", lambda i: kernels.linear(x768, fc[i]),
         lambda i: F.linear(x768, fc[i]), 3072 * 768),
    ]  # fmt: skip
    print("| kernel | weight MiB | ms | GB/s read | / read-only | / copy |")
    print("|---|---|---|---|---|---|")
    for name, run, ref, numel in cases:
        got, want = run(0), ref(0)
        for a, b in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, list) else (want,), strict=True):  # fmt: skip
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        seconds = _median(lambda r, run=run: run(r % COPIES), args.reps)
        rate = numel * 4 / seconds
        print(f"| {name} | {numel * 4 / 2**20:.2f} | {seconds * 1e3:.3f} | {rate / 1e9:.1f} | "
              f"{rate / read_rate:.2f} | {rate / copy_rate:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
