"""A training loop that saves asynchronously after every step until it is killed.

Used by test_checkpoint_async.py, which starts it (forked from a preloaded server, so each start
costs no import), kills it with SIGKILL at a random moment and checks that `latest` still names
a complete tag holding exactly the weights the loop had when it saved that tag. Before each save
the loop writes those weights to `expect/<tag>.pt` (atomically), so the check needs nothing from
the killed process.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

WIDTH, LAYERS = 384, 8  # 1.2M parameters: 4.7 MB of weights, 9.4 MB of Adam moments per save


def build():
    import minispeed.engine as deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={
            "train_batch_size": 4,
            "zero_optimization": {"stage": 1},
            "checkpoint": {"async_save": True},
        },
    )
    return engine


def run(out: str, steps: int = 10_000, rank: int = 0, world_size: int = 1, port: int = 0) -> None:
    """Train, saving after every step; `out/ready` appears once the first save has landed.

    With `world_size` > 1 this is one rank of a job whose ranks meet at 127.0.0.1:`port`.
    """
    import minispeed.engine.checkpoint.background as ckpt_async
    from minispeed.zero.checkpoints.layout import atomic_save

    if world_size > 1:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )  # fmt: skip
    torch.set_num_threads(1)
    out_dir = Path(out)
    (out_dir / "expect").mkdir(parents=True, exist_ok=True)
    engine = build()
    x = torch.randn(4, WIDTH)
    saver = ckpt_async.checkpointer_of(engine)
    try:
        for step in range(1, steps + 1):
            loss = engine(x).square().mean()
            engine.backward(loss)
            engine.step()
            tag = f"global_step{engine.global_steps}"
            if rank == 0:  # ZeRO-1: every rank holds the whole model, the same on each
                weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
                atomic_save(weights, out_dir / "expect" / f"{tag}.pt")
            engine.save_checkpoint(out_dir / "ckpt", tag=tag)
            if step == 1:
                saver.wait()  # collective
                if rank == 0:
                    (out_dir / "ready").touch()
        saver.wait()
    except Exception:
        # A peer died: what a normal interpreter exit would run (the atexit join of the save in
        # flight), which a forked child's os._exit skips.
        saver._at_exit()
        os._exit(1)
    os._exit(0)


def save_once_and_exit(out: str) -> None:
    """One step, one asynchronous save, then a normal interpreter exit (no explicit wait)."""
    engine = build()
    engine.backward(engine(torch.randn(4, WIDTH)).square().mean())
    engine.step()
    engine.save_checkpoint(Path(out) / "ckpt")


if __name__ == "__main__":
    import sys

    save_once_and_exit(sys.argv[1])
