"""How tokens travel through one MoE layer on 2 ranks, for a real batch of text.

Run: `.venv/bin/torchrun --nproc_per_node 2 benchmarks/moe_token_travel.py`

Each rank takes 256 consecutive characters of the bundled corpus (`examples/data/corpus.txt`;
rank r starts at character 4096·r), embeds them with a fixed random table (d = 64) and routes
them through one MoE layer: E = 8 experts, E_p = 2 (ranks 0 and 1 hold experts 0-3 and 4-7),
top-2, capacity factor 1.0, min_capacity 4. Printed per rank: what the gate wanted, what fit,
rows sent to and received from each rank, and the all-to-all bytes the comms logger recorded
against `costs.all_to_all_bytes`. Then 100 Adam steps (lr 0.02) on the aux loss alone show what it pushes
toward: the per-expert counts flatten and the loss approaches its minimum, 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import minispeed.comm as comm
import minispeed.moe as moe

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "data" / "corpus.txt"
D, E, EP, K, TOKENS = 64, 8, 2, 2, 256
AUX_STEPS, AUX_LR = 100, 0.01


def main() -> None:
    comm.init_distributed()
    rank, world = comm.get_rank(), comm.get_world_size()
    text = CORPUS.read_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text[4096 * rank : 4096 * rank + TOKENS]])
    torch.manual_seed(0)
    embed = nn.Embedding(len(vocab), D)
    groups = moe.ExpertGroups(EP)
    cfg = moe.MoEConfig(num_experts=E, expert_parallel_degree=EP, top_k=K, capacity_factor=1.0,
                        random_token_selection=False, aux_loss_coef=1.0)  # fmt: skip
    layer = moe.MoE(D, nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)), cfg,
                    groups)  # fmt: skip
    x = embed(ids).detach()
    with comm.CommsLogger() as log:
        layer(x).sum().backward()
    r = layer.last_routing
    e_local = E // EP
    rows_to = [r.capacity * e_local] * EP
    a2a = [rec.wire_bytes for rec in log.filter(op="all_to_all")]
    lines = [
        f"rank {rank}: S={TOKENS} tokens, k·S={K * TOKENS} assignments, C={r.capacity}",
        f"  offered per expert  {r.expert_counts.tolist()}",
        f"  kept per expert     {r.kept_counts.tolist()}  dropped {r.dropped_assignments} "
        f"assignments, {r.dropped_tokens} tokens lost both choices",
        f"  kept rows for rank  {[int(r.kept_counts[j * e_local : (j + 1) * e_local].sum()) for j in range(EP)]}"
        f" (buffer rows {rows_to}, empty slots padded)",
        f"  all-to-all wire bytes per call {a2a} (formula "
        f"{moe.all_to_all_bytes(rows_to, groups.expert_rank, D * 4)})",
    ]
    for turn in range(world):
        if turn == rank:
            print("\n".join(lines), flush=True)
        comm.barrier()
    # What the aux loss pushes toward: train the gate on it alone.
    opt = torch.optim.Adam(layer.gate.parameters(), lr=AUX_LR)
    for step in range(AUX_STEPS + 1):
        opt.zero_grad()
        layer(x)
        loss = moe.aux_loss(layer)
        if step % (AUX_STEPS // 4) == 0 and rank == 0:
            r = layer.last_routing
            first = torch.bincount(r.expert_index[:, 0], minlength=E).tolist()
            p = r.probs.mean(0)
            print(
                f"aux-only step {step:3d}: aux loss {loss.item():.3f}, mean P_e in "
                f"[{p.min():.3f}, {p.max():.3f}], mean top prob {r.probs.max(1).values.mean():.3f}"
                f", rank 0 first choices {first}, dropped {r.dropped_assignments}"
            )
        loss.backward()
        moe.reduce_gradients(layer, groups)
        opt.step()
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
