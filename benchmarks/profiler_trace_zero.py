"""A ZeRO training step as a timeline: the script `python -m minispeed.profiler trace` runs.

    python -m minispeed.profiler trace --nproc 2 --out zero3.json \\
        benchmarks/profiler_trace_zero.py --stage 3

Three steps of examples/gpt.py's GPT under `minispeed.zero.shard` (AdamW), each wrapped in
`profiler.traced_step()`; the command records step 1 on every rank and merges the ranks into
one Chrome trace (open it at https://ui.perfetto.dev): per rank a `compute` track and one track
per collective (`comm.*` / `zero*` ranges where the packages mark them, gloo's own
`gloo:*` worker events and the `c10d::*` calls otherwise).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from gpt import GPT, GPTConfig

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed import profiler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=3, choices=(0, 1, 2, 3))
    args = parser.parse_args()
    comm.init_distributed()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=64))
    config = zero.ZeroConfig(stage=args.stage, stage3_param_persistence_threshold_numel=0)
    opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    g = torch.Generator().manual_seed(comm.get_rank())
    for _ in range(3):
        with profiler.traced_step():
            idx = torch.randint(0, 64, (4, 33), generator=g)
            _, loss = model(idx[:, :-1], idx[:, 1:])
            opt.backward(loss)
            opt.step()
    opt.close()
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
