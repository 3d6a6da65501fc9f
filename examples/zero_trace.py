"""Print every collective one ZeRO training step issues, in order, with its bytes: a real trace.

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/zero_trace.py --stage 2

Runs two optimizer steps of the GPT in examples/gpt.py (gradient accumulation 2, so stage 2's
per-micro-step reduce-scatter shows) with the comms logger on, and prints rank 0's second step:
which collective, during which phase (backward of micro-step 1 or 2, or the optimizer step), how
many elements and bytes, and the bytes this rank sent. The last line compares the step's total
with the ledger's closed form (:func:`minispeed.zero.ledger.approx_wire_bytes_per_step`).
docs/packages/zero.md quotes its output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import GPT, GPTConfig

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.zero.ledger import approx_wire_bytes_per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    parser.add_argument("--bucket-numel", type=int, default=40_000)
    args = parser.parse_args()

    comm.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=53, block_size=32, n_layer=2, n_head=2, n_embd=64))
    numel = sum(p.numel() for p in model.parameters())
    config = zero.ZeroConfig(
        stage=args.stage,
        reduce_bucket_numel=args.bucket_numel,
        gradient_accumulation_steps=2,
        stage3_param_persistence_threshold_numel=0,
    )
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    g = torch.Generator().manual_seed(rank)
    phases: list[tuple[int, str]] = []  # (index of the first record of the phase, its name)
    with comm.CommsLogger() as log:
        for _ in range(2):  # two optimizer steps; rank 0 prints the second
            log.mark_step()
            for micro in range(2):
                idx = torch.randint(0, 53, (4, 33), generator=g)
                phases.append((len(log.records), f"micro-step {micro + 1}: forward + backward"))
                _, loss = model(idx[:, :-1], idx[:, 1:])
                opt.backward(loss)
                phases.append((len(log.records), "optimizer step"))
                opt.step()
    if rank != 0:
        return
    second = [(i, r) for i, r in enumerate(log.records) if r.step == 2]
    names = dict(phases)
    print(f"ZeRO stage {args.stage}, N = {world} ranks, Ψ = {numel:,} parameters, fp32")
    print(
        f"{'phase':<36} {'collective':<15} {'elements':>9} {'msg bytes':>10} {'sent by rank 0':>15}"
        "  run as"
    )
    phase = ""
    for i, r in second:
        phase = names.get(i, phase)
        print(
            f"{phase:<36} {r.op:<15} {r.numel:>9,} {r.msg_bytes:>10,} {r.wire_bytes:>15,}  {r.impl}"
        )
    total = sum(r.wire_bytes for _, r in second)
    closed = approx_wire_bytes_per_step(
        args.stage, numel, world, 4, 4, 2, reduce_scatter_impl=comm.reduce_scatter_impl()
    )
    print(
        f"sent this step: {total:,} bytes; ledger closed form (no padding, no flags): {closed:,.0f}"
    )


if __name__ == "__main__":
    main()
