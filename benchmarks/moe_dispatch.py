"""Dispatch + combine of one MoE layer: the permutation op vs its reference vs the dense einsum.

Run: `.venv/bin/python benchmarks/moe_dispatch.py [--repeats 5] [--threads N]`

For each size, one routing (top-k, capacity factor 1.25, dropping on) is computed once; then
each implementation moves the S tokens into the (E·C, d) expert buffer and combines the buffer
back into S weighted token rows, forward only:

- `op`: `permute.gather_rows` + `permute.combine_rows` (the C++ op, widest SIMD path);
- `reference`: the same two functions in plain PyTorch indexing (the fallback);
- `einsum`: `einsum("sec,sd->ecd")` and `einsum("sec,ecd->sd")` with the (S, E, C) one-hot mask
  (built outside the timing, so the einsum is not charged for it).

The op moves k·S·d + E·C·d elements each way; the einsum does S·E·C·d multiply-adds each way.
All three run round-robin in one process on the same data; best of `--repeats`.
"""

from __future__ import annotations

import argparse

import torch
from timing import best_round_robin

import minispeed.moe as moe
from minispeed.moe import dispatch_einsum as de
from minispeed.moe import permute as P

SIZES = [  # (tokens S, width d, experts E, k)
    (1024, 256, 8, 2),
    (4096, 512, 8, 2),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if P.load_op("cpu") is None:
        raise SystemExit("the moe_permute op cannot be built here; nothing to compare")
    print(f"threads={args.threads}, SIMD levels {P.load_op('cpu').simd_levels()}")
    print("S     d    E  k  C     | op ms  | reference ms | einsum ms | einsum/op | ref/op")
    for s, d, e, k in SIZES:
        torch.manual_seed(0)
        cfg = moe.MoEConfig(num_experts=e, top_k=k, capacity_factor=1.25,
                            random_token_selection=False)  # fmt: skip
        gate = moe.TopKGate(d, cfg).eval()
        x = torch.randn(s, d)
        with torch.no_grad():
            r = gate(x)
            plan = moe.plan_dispatch(r)
            mask = de.dispatch_mask(r)
            cw = de.combine_weights(r, mask)
        w = r.weight.detach()

        def op(x=x, plan=plan, w=w):
            buf = P.gather_rows(x, plan.slot_token)
            return P.combine_rows(buf, plan.token_slot, w)

        def ref(x=x, plan=plan, w=w):
            buf = P.reference.gather_rows(x, plan.slot_token)
            return P.reference.combine_rows(buf, plan.token_slot, w)

        def einsum(x=x, mask=mask, cw=cw):
            buf = de.einsum_dispatch(x, mask)
            return de.einsum_combine(buf, cw)

        torch.testing.assert_close(op(), einsum(), rtol=1e-4, atol=1e-4)
        t = best_round_robin({"op": op, "reference": ref, "einsum": einsum}, args.repeats)
        print(
            f"{s:<5} {d:<4} {e:<2} {k}  {r.capacity:<5} | {t['op'] * 1e3:6.2f} | "
            f"{t['reference'] * 1e3:12.2f} | {t['einsum'] * 1e3:9.2f} | "
            f"{t['einsum'] / t['op']:9.1f} | {t['reference'] / t['op']:6.2f}"
        )


if __name__ == "__main__":
    main()
