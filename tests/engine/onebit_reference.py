"""A single-process simulation of 1-bit Adam on N data-parallel ranks: the tests' oracle.

Written from the algorithm's description (`minispeed.zero.onebit` and
`minispeed.comm.compression.compressed_allreduce` docstrings), not from the code under test:
every "rank" is a loop iteration, the compressed all-reduce is N worker and N server
error-feedback streams over one `OnebitCompressor`, and the warm-up is `torch.optim.Adam` on the
ranks' averaged gradients.

Data: step s has N·A micro-batches of `MICRO` rows; rank r takes micro-batches r·A .. r·A + A-1.
"""

from __future__ import annotations

import math

import torch

from minispeed.comm.compression import ErrorFeedback, OnebitCompressor

MICRO = 2
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


class Net(torch.nn.Module):
    """46 parameters; `forward(x, y)` returns the mean squared error."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dtype = self.net[0].weight.dtype  # 16-bit training: inputs in the model's dtype
        return torch.nn.functional.mse_loss(self.net(x.to(dtype)).float(), y)


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Net()


def micro_batch(step: int, rank: int, j: int, accumulation: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s micro-batch `j` of global step `step` (deterministic)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * (rank * accumulation + j))
    x = torch.randn(MICRO, 7, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)


def _local_grads(model, step, rank, accumulation) -> list[torch.Tensor]:
    """One rank's gradient of its window: Σ_j ∇(loss_j / A), as the engine accumulates it."""
    for p in model.parameters():
        p.grad = None
    for j in range(accumulation):
        (
            loss_of(model, *micro_batch(step, rank, j, accumulation)) * (1.0 / accumulation)
        ).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _clip(grads: list[torch.Tensor], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_'s rule, in place."""
    if max_norm <= 0:
        return
    norm = torch.cat([g.reshape(-1) for g in grads]).pow(2).sum().sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)


class SimulatedOnebitAllReduce:
    """N ranks' 1-bit all-reduce (average) with worker and server error feedback, on one process."""

    def __init__(self, numel: int, n: int) -> None:
        self.n = n
        self.chunk = 8 * math.ceil(numel / (8 * n))
        compressor = OnebitCompressor(chunk_numel=self.chunk)
        self.workers = [ErrorFeedback(compressor) for _ in range(n)]
        self.servers = [ErrorFeedback(compressor) for _ in range(n)]
        self.compressor = compressor

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        n, c = self.n, self.chunk
        sent = []
        for x, worker in zip(xs, self.workers):
            padded = torch.zeros(n * c)
            padded[: x.numel()] = x
            sent.append(self.compressor.decompress(worker.compress(padded)))
        out = []
        for r, server in enumerate(self.servers):
            mean = torch.stack([d[r * c : (r + 1) * c] for d in sent]).mean(0)
            out.append(self.compressor.decompress(server.compress(mean)))
        return torch.cat(out)[: xs[0].numel()]


def simulate(
    steps: int, freeze_step: int, n: int = 2, accumulation: int = 1, max_norm: float = 0.0
) -> dict[str, list]:
    """1-bit Adam on `n` simulated ranks: per-step parameter vectors and mean losses."""
    model = make_model()
    params = list(model.parameters())
    adam = torch.optim.Adam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    allreduce = SimulatedOnebitAllReduce(sum(p.numel() for p in params), n)
    beta1, beta2 = BETAS
    m = None
    out: dict[str, list] = {"params": [], "losses": []}
    for step in range(steps):
        with torch.no_grad():
            out["losses"].append(
                sum(
                    loss_of(model, *micro_batch(step, r, j, accumulation)).item()
                    for r in range(n)
                    for j in range(accumulation)
                )
                / (n * accumulation)
            )
        local = [_local_grads(model, step, r, accumulation) for r in range(n)]
        if step < freeze_step:  # warm-up: Adam on the averaged gradient, global-norm clipping
            averaged = [sum(g * (1.0 / n) for g in gs) for gs in zip(*local)]
            _clip(averaged, max_norm)
            for p, g in zip(params, averaged):
                p.grad = g
            adam.step()
        else:
            if m is None:  # the freeze: m from Adam's state, v frozen
                m = torch.cat([adam.state[p]["exp_avg"].reshape(-1) for p in params])
            t = step + 1
            momenta = []
            for grads in local:  # every rank: its clipped local gradient into its momentum
                _clip(grads, max_norm)
                g = torch.cat([(gr + WD * p.detach()).reshape(-1) for gr, p in zip(grads, params)])
                momenta.append(m.clone().lerp_(g, 1 - beta1))
            m = allreduce(momenta)
            with torch.no_grad():
                off = 0
                for p in params:
                    v = adam.state[p]["exp_avg_sq"]
                    denom = (v.sqrt() / (1 - beta2**freeze_step) ** 0.5).add_(EPS)
                    p.addcdiv_(
                        m[off : off + p.numel()].view_as(p), denom, value=-LR / (1 - beta1**t)
                    )
                    off += p.numel()
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
    return out


def plain_adam(steps: int, n: int = 2, accumulation: int = 1) -> dict[str, list]:
    """torch.optim.Adam on one process on each step's whole global batch."""
    model = make_model()
    adam = torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    out: dict[str, list] = {"params": [], "losses": []}
    for step in range(steps):
        batches = [
            micro_batch(step, r, j, accumulation) for r in range(n) for j in range(accumulation)
        ]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        adam.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        adam.step()
        out["losses"].append(loss.item())
        out["params"].append(
            torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        )
    return out
