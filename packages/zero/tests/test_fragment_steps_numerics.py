"""Per-parameter optimizer step counts under flat partitions (issue 14, item 1).

PyTorch keeps Adam's ``step`` per parameter: a parameter with no gradient is skipped and its
count does not advance, so its bias correction later differs from its neighbours'. Stages 1-2
keep parameters in shared flat buffers; the inner optimizer must still count steps per
parameter (Note [one master per fragment] in stage12.py). ``odd`` below is used only on odd
steps, on every rank, and shares its bucket with the others; losses and weights must follow
single-process PyTorch at every step, in every stage, for AdamW, Adam and SGD with momentum.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.testing import run_distributed

STEPS, WORLD, ROWS = 6, 2, 4


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.odd = nn.Parameter(torch.randn(8))
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_odd: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if use_odd:
            h = h * self.odd
        return self.b(h).pow(2).mean()


def _data(step: int, rank: int) -> torch.Tensor:
    return torch.randn(ROWS, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.05)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def _reference(kind: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = Model()
    opt = _optimizer(kind, model.parameters())
    losses, weights = [], []
    for s in range(STEPS):
        loss = sum(model(_data(s, r), s % 2 == 1) for r in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        weights.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return losses, weights


def _body(rank: int, world_size: int, stage: int, kind: str):
    model = Model()
    config = zero.ZeroConfig(stage=stage, stage3_param_persistence_threshold_numel=0)
    opt = zero.shard(model, _optimizer(kind, model.parameters()), config=config)
    losses, weights = [], []
    for s in range(STEPS):
        loss = model(_data(s, rank), s % 2 == 1)
        opt.backward(loss)
        assert opt.step()
        mean = loss.detach().clone()
        comm.all_reduce(mean)
        losses.append(mean.item() / world_size)
        if stage == 3:
            with zero.GatheredParameters(list(model.parameters())):
                weights.append({k: v.detach().clone() for k, v in model.named_parameters()})
        else:
            weights.append({k: v.detach().clone() for k, v in model.named_parameters()})
    return losses, weights


@pytest.mark.parametrize(
    "stage,kind",
    [(0, "adamw"), (1, "adamw"), (2, "adamw"), (3, "adamw"), (1, "adam"), (2, "sgd")],
)
def test_a_parameter_skipped_on_even_steps_is_bias_corrected_like_pytorch(
    stage: int, kind: str
) -> None:
    want_losses, want_weights = _reference(kind)
    for losses, weights in run_distributed(
        _body, world_size=WORLD, args=(stage, kind), timeout_s=120
    ):
        for s in range(STEPS):
            torch.testing.assert_close(
                losses[s], want_losses[s], rtol=1e-5, atol=0, msg=f"loss at step {s}"
            )
            for name, w in want_weights[s].items():
                torch.testing.assert_close(
                    weights[s][name], w, rtol=1e-5, atol=1e-7, msg=f"{name} after step {s}"
                )
