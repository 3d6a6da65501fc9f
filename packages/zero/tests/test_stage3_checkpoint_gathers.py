"""Under activation checkpointing, stage 3's backward gathers each parameter once, as without it.

Note [recomputation keeps its unit] (stage3/coordinator.py): a block's forward run again inside
backward (non-reentrant ``torch.utils.checkpoint``, early stopping off) gathers its modules'
parameters, and they stay gathered for those modules' backward, which follows. Released at the
end of the recomputed forward, as a forward releases them, they were gathered again by the
backward: more all-gather bytes per step than ``stage3_step_bytes`` states. On 2 gloo ranks,
four checkpointed blocks of two ``Linear(320, 320)`` (weights above the persistence threshold),
step 3: the backward's all-gather bytes equal the forward's and the ledger's, and the losses
equal the same model's trained without checkpointing, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3 import stage3_step_bytes

WIDTH, BLOCKS = 320, 4


class _Block(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.recompute = recompute
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:  # the whole block recomputed, as zero.checkpoint does
            with set_checkpoint_early_stop(False):
                return x + checkpoint(self.body, x, use_reentrant=False)
        return x + self.body(x)


def _model(recompute: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(_Block(recompute) for _ in range(BLOCKS)))


def _train(rank: int, recompute: bool) -> dict:
    model = _model(recompute)
    opt = zero.shard(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=zero.ZeroConfig(stage=3)
    )
    xs = [
        torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * rank + k))
        for k in range(3)
    ]
    losses, gathered = [], []
    for x in xs:
        with comm.CommsLogger() as fwd:
            loss = model(x).square().mean()
        with comm.CommsLogger() as bwd:
            opt.backward(loss)
        opt.step()
        losses.append(loss.item())
        gathered.append(
            [
                sum(
                    r.msg_bytes
                    for r in log.records
                    if r.op.startswith("all_gather") and r.dtype == "torch.float32"
                )
                for log in (fwd, bwd)
            ]
        )
    opt.close()
    return dict(losses=losses, gathered=gathered)


def _body(rank: int, world_size: int) -> list[dict]:
    return [_train(rank, recompute=False), _train(rank, recompute=True)]


def test_checkpointed_blocks_are_gathered_once_in_backward() -> None:
    numels = [p.numel() for p in _model(False).parameters()]
    want = stage3_step_bytes(
        numels, 2, persistence_threshold_numel=100_000, param_bytes=4, grad_bytes=4
    )
    for ref, got in run_distributed(_body, world_size=2, timeout_s=120):
        assert got["losses"] == ref["losses"]
        assert got["gathered"][2] == [want.forward_all_gather, want.backward_all_gather], got
