"""A job for the node-local checkpoint test: started as two torchrun agents on one machine acting
as two nodes, each node's ranks saving to their own directory (`--out/node<N>`).

It first saves with the default config (one shared directory assumed), which must be refused on
every rank before anything is written; then, with `checkpoint.use_node_local_storage`, saves and
loads at ZeRO stages 0 and 1 and records the evaluation loss before and after. Each rank writes
what it saw to `--out/rank<R>.json`.
"""

import argparse
import json
import os
from pathlib import Path

import torch
from torch import nn

import minispeed.engine as deepspeed


def build(stage: int, node_local: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={
            "train_batch_size": 4,
            "zero_optimization": {"stage": stage},
            "checkpoint": {"use_node_local_storage": node_local},
        },
    )
    return engine


def train(engine, rank: int) -> None:
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        engine.backward(engine(torch.randn(2, 8, generator=g)).square().mean())
        engine.step()


def evaluate(engine) -> float:
    with torch.no_grad():
        return engine(torch.ones(2, 8)).square().mean().item()


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)  # minispeed run passes it
    args = parser.parse_args()
    out = Path(args.out)
    rank, node = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
    mine = out / f"node{node}"  # this node's own directory: the other node never sees it
    seen: dict = {"node": node}

    engine = build(1, node_local=False)
    train(engine, rank)
    try:
        engine.save_checkpoint(mine / "shared")
        seen["refused"] = None
    except Exception as e:
        seen["refused"] = f"{type(e).__name__}: {e}"
    seen["files_after_refusal"] = files(mine / "shared")

    for stage in (0, 1):
        engine = build(stage, node_local=True)
        train(engine, rank)
        engine.save_checkpoint(mine / f"stage{stage}", client_state={"node": node})
        fresh = build(stage, node_local=True)
        before = evaluate(fresh)
        _, client = fresh.load_checkpoint(mine / f"stage{stage}")
        seen[f"stage{stage}"] = {
            "saved": evaluate(engine),
            "fresh": before,
            "loaded": evaluate(fresh),
            "client": client,
            "steps": fresh.global_steps,
            "files": files(mine / f"stage{stage}"),
        }
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main()
