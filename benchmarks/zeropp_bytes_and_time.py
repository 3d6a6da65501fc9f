"""ZeRO++ against plain stage 3 in one run: bytes across the node boundary, step time, convergence.

Run::

    .venv/bin/python benchmarks/zeropp_bytes_and_time.py                 # 200 steps, small GPT
    .venv/bin/python benchmarks/zeropp_bytes_and_time.py --width 512 --layers 8 --steps 6

Four gloo processes on this machine, arranged as 2 "nodes" × 2 (``LOCAL_WORLD_SIZE=2``), train a
character-level GPT on the bundled corpus (examples/data/corpus.txt) with stage 3 and each
ZeRO++ combination, from the same weights on the same batches. Per combination:

- *bytes per step*: one steady step (the third) under the comms logger, message bytes per axis
  (`bytes_by_axis`: world / intra-node / inter-node) and, summed over the 4 ranks, the bytes
  that cross the node boundary (`cross_node_bytes`, ring model);
- *step time*: median over the steps after the third, without the logger; reported as a ratio
  to plain stage 3 from the same run (the machine is shared: absolute times mean little);
- *convergence*: the loss of every step; the table shows the mean of the last 10 steps and the
  largest relative difference from plain stage 3 at any step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CORPUS = Path(__file__).resolve().parent.parent / "examples" / "data" / "corpus.txt"
NODE_SIZE = 2
COMBOS = {
    "stage 3": (False, False, False),
    "qwZ": (True, False, False),
    "hpZ": (False, True, False),
    "qgZ": (False, False, True),
    "qwZ+hpZ+qgZ": (True, True, True),
}


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=idx.device), diagonal=1)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(steps: int, batch: int, seq: int) -> tuple[int, list]:
    text = CORPUS.read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        out.append((rows[:, :-1], rows[:, 1:]))
    return len(chars), out


def _body(rank: int, world_size: int, args: dict) -> dict:
    import minispeed.comm as comm
    import minispeed.zero as zero
    from minispeed.zero.stage3 import bytes_by_axis, cross_node_bytes

    os.environ["LOCAL_WORLD_SIZE"] = str(NODE_SIZE)  # emulate 2 nodes (torchrun sets it)
    vocab, batches = _batches(args["steps"], args["batch"], args["seq"])
    share = args["batch"] // world_size
    results = {}
    # The first configuration would pay the process's warm-up (allocator, op loading): a short
    # unreported run of plain stage 3 first.
    runs = [("warm-up", COMBOS["stage 3"], batches[: args["warmup"]])]
    runs += [(name, combo, batches) for name, combo in COMBOS.items()]
    for name, (qw, hpz, qg), run_batches in runs:
        torch.manual_seed(0)
        model = GPT(vocab, args["width"], args["heads"], args["layers"], args["seq"])
        cfg = zero.ZeroConfig(
            stage=3,
            quantized_weights=qw,
            hpz_partition_size=NODE_SIZE if hpz else 1,
            quantized_gradients=qg,
            reduce_bucket_numel=args["bucket"],
            stage3_param_persistence_threshold_numel=args["persistence"],
        )
        opt = zero.shard(model, torch.optim.AdamW(model.parameters(), lr=args["lr"]), config=cfg)
        losses, times, axes, cross = [], [], {}, 0
        for step, (idx, tgt) in enumerate(run_batches):
            idx, tgt = (
                idx[rank * share : (rank + 1) * share],
                tgt[rank * share : (rank + 1) * share],
            )
            logged = step == 2
            comm.barrier()
            log = comm.CommsLogger()
            if logged:
                log.__enter__()
            t0 = time.perf_counter()
            loss = model(idx, tgt)
            opt.backward(loss)
            opt.step()
            elapsed = time.perf_counter() - t0
            if logged:
                log.__exit__(None, None, None)
                axes = bytes_by_axis(log.records, NODE_SIZE)
                cross = sum(
                    cross_node_bytes(r, rank, NODE_SIZE)
                    for r in log.records
                    if r.dtype != "torch.int64"
                )
            elif step > 2:
                times.append(elapsed)
            mean = loss.detach().reshape(1).clone()
            comm.all_reduce(mean)
            losses.append(mean.item() / world_size)
        results[name] = {
            "losses": losses,
            "step_s": statistics.median(times) if times else math.nan,
            "axes": {f"{op}/{axis}": b for (op, axis), b in sorted(axes.items())},
            "cross_node_bytes": cross,
        }
        opt.close()
    del results["warm-up"]
    results["params"] = sum(p.numel() for p in model.parameters())
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch (4 ranks)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bucket", type=int, default=500_000_000, help="reduce_bucket_numel")
    parser.add_argument(
        "--persistence",
        type=int,
        default=1000,
        help="stage3_param_persistence_threshold_numel (DeepSpeed's 1e5 would keep every matrix "
        "of the small model gathered, and ZeRO++ would have nothing to do)",
    )
    parser.add_argument("--warmup", type=int, default=5, help="unreported plain steps first")
    parser.add_argument("--json", type=str, default="", help="write the results here too")
    args = vars(parser.parse_args(argv))
    if args["steps"] < 4:
        parser.error("--steps must be >= 4 (step 3 is logged, later steps are timed)")

    from rich.console import Console
    from rich.table import Table

    from minispeed.core.testing import run_distributed

    per_rank = run_distributed(_body, world_size=4, args=(args,), timeout_s=3600)
    first = per_rank[0]
    base = first["stage 3"]
    table = Table(
        title=f"ZeRO++ vs stage 3: GPT {first['params'] / 1e6:.2f}M params, 4 gloo ranks as 2 "
        f"nodes x 2, {args['steps']} steps (loaded machine: compare ratios)"
    )
    for col in (
        "config",
        "cross-node B/step (all ranks)",
        "vs stage 3",
        "message bytes per axis (rank 0)",
        "step time vs stage 3",
        "loss, last 10",
        "max |Δloss|/loss",
    ):
        table.add_column(
            col, justify="left" if col in ("config", "message bytes per axis (rank 0)") else "right"
        )
    summary = {"args": args, "params": first["params"], "configs": {}}
    for name in COMBOS:
        cross = sum(r[name]["cross_node_bytes"] for r in per_rank)
        base_cross = sum(r["stage 3"]["cross_node_bytes"] for r in per_rank)
        step = statistics.median(r[name]["step_s"] for r in per_rank)
        base_step = statistics.median(r["stage 3"]["step_s"] for r in per_rank)
        losses = first[name]["losses"]
        tail = statistics.fmean(losses[-10:])
        dev = max(abs(a - b) / b for a, b in zip(losses, base["losses"]))
        axes = ", ".join(f"{k} {v:,}" for k, v in first[name]["axes"].items())
        table.add_row(
            name,
            f"{cross:,}",
            f"{cross / base_cross:.3f}",
            axes,
            f"{step / base_step:.2f}",
            f"{tail:.4f}",
            f"{dev:.4f}",
        )
        summary["configs"][name] = {
            "cross_node_bytes": cross,
            "cross_ratio": cross / base_cross,
            "axes_rank0": first[name]["axes"],
            "step_time_ratio": step / base_step,
            "loss_first": losses[0],
            "loss_last10": tail,
            "max_rel_loss_diff": dev,
        }
    Console(width=200).print(table)
    if args["json"]:
        Path(args["json"]).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
