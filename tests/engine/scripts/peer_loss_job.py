"""One rank of a 2-rank job whose rank 1 is killed (SIGKILL) while its second asynchronous save
is being written, before its done marker lands. test_checkpoint_peer_loss.py forks it from a
preloaded server (so no start pays the imports) as two processes with no agent, as two nodes
are: nothing tears the survivor down for it.

MODE `collective`: rank 0 trains on, so its next collective finds rank 1 gone, and it exits on
that error. MODE `quiet`: rank 0 ends at once, with no collective left to fail. Either way rank
0's exit must not wait for rank 1's done marker beyond the process group's timeout, and
`latest` stays on the first save.
"""

from __future__ import annotations

import atexit
import datetime
import os
import signal
import sys
import traceback
from pathlib import Path

import torch
from torch import nn


def _job(mode: str, out: Path, rank: int, timeout_s: float) -> None:
    import minispeed.engine as deepspeed
    from minispeed.zero.checkpoints.pending import PendingSave

    deepspeed.init_distributed(timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={
            "train_batch_size": 4,
            "zero_optimization": {"stage": 1},
            "checkpoint": {"async_save": True},
        },
    )
    if rank == 1:
        write_done_marker = PendingSave.write_done_marker

        def die_at_the_second_save(self, sizes):
            if self.tag == "global_step2":
                os.kill(os.getpid(), signal.SIGKILL)
            write_done_marker(self, sizes)

        PendingSave.write_done_marker = die_at_the_second_save

    def train_step() -> None:
        engine.backward(engine(torch.randn(2, 8)).square().mean())
        engine.step()

    train_step()
    engine.save_checkpoint(out / "ckpt")  # lands: the next save waits for it on every rank
    train_step()
    engine.save_checkpoint(out / "ckpt")  # rank 1 dies while writing this one
    if mode == "collective":
        for _ in range(100):  # rank 0: the first of these collectives fails
            train_step()


def run(mode: str, out: str, rank: int, port: int, timeout_s: float) -> None:
    """The job as one rank, ending as the interpreter would (a forked child's exit skips it):
    an uncaught exception is printed and kept in `sys.last_value`, then the `atexit` functions
    run (the background save's wait among them). stderr goes to `out/stderr.rank<R>`."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    with open(Path(out) / f"stderr.rank{rank}", "w") as err:
        os.dup2(err.fileno(), 2)
    code = 0
    try:
        _job(mode, Path(out), rank, timeout_s)
    except BaseException as e:
        traceback.print_exc()
        sys.last_value, code = e, 1
    atexit._run_exitfuncs()
    sys.stderr.flush()
    os._exit(code)
