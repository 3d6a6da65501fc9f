"""Tiny models and the single-process reference the pipeline tests compare with."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import minispeed.pipeline as pipeline
from minispeed.pipeline import LayerSpec, TiedLayerSpec

VOCAB, WIDTH, SEQ = 16, 8, 4


class Block(nn.Module):
    """A residual MLP block: x + W2 tanh(W1 x). (B, T, C) -> (B, T, C)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def lm_head(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    """Output projection tied to the input embedding: (B, T, C) -> (B, T, V)."""
    return h @ embedding.weight.T


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def tiny_gpt(blocks: int = 4) -> list:
    """Embedding, `blocks` MLP blocks, output head tied to the embedding."""
    return [
        TiedLayerSpec(nn.Embedding, (VOCAB, WIDTH), key="embed"),
        *[LayerSpec(Block, (WIDTH,)) for _ in range(blocks)],
        TiedLayerSpec(nn.Embedding, (VOCAB, WIDTH), key="embed", forward_fn=lm_head),
    ]


class MaskedEmbed(nn.Module):
    """tokens (B, T) -> (hidden (B, T, C), mask (B, T) bool): a tuple with a tensor that needs no grad."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.emb(tokens), tokens.ne(0)


class MaskedBlock(Block):
    """(h, mask) -> (h + mask · mlp(h), mask): the mask rides along to every stage."""

    def forward(self, hm: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = hm
        return h + self.down(torch.tanh(self.up(h))) * mask.unsqueeze(-1), mask


class MaskedHead(nn.Linear):
    """(h, mask) -> logits (B, T, V)."""

    def forward(self, hm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(hm[0])


def masked_model(blocks: int = 4) -> list:
    """Stages exchange (hidden, bool mask) tuples: the mask needs no gradient and gets none."""
    return [
        LayerSpec(MaskedEmbed, (VOCAB, WIDTH)),
        *[LayerSpec(MaskedBlock, (WIDTH,)) for _ in range(blocks)],
        LayerSpec(MaskedHead, (WIDTH, VOCAB)),
    ]


def albert(blocks: int = 4) -> list:
    """Embedding, ONE block applied `blocks` times (ALBERT-style: a single set of weights, used
    by several layers of a stage and by several stages), output head."""
    return [
        LayerSpec(nn.Embedding, (VOCAB, WIDTH)),
        *[TiedLayerSpec(Block, (WIDTH,), key="shared") for _ in range(blocks)],
        LayerSpec(nn.Linear, (WIDTH, VOCAB)),
    ]


MODELS = {"gpt": tiny_gpt, "masked": masked_model, "albert": albert}


def data(steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def reference(
    layers: list, steps: int, batch: int, lr: float = 0.05, start: dict | None = None
) -> tuple[list[float], dict]:
    """The unsplit model on one process: losses and final parameters by name (starting from the
    parameters `start`, named as `build_unsplit`'s, when given)."""
    model = pipeline.build_unsplit(layers)
    if start is not None:
        model.load_state_dict(start)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in data(steps, batch):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def stage_params(module: pipeline.PipelineModule) -> dict[str, torch.Tensor]:
    """This stage's parameters, named as in `build_unsplit` (`layers.<i>.*`, `tied.<key>.*`)."""
    out = {}
    for name, value in module.state_dict().items():
        if name.startswith("chunks."):
            name = name.split(".", 2)[2]
        out[name] = value.detach().clone()
    return out


def train_pipeline(
    rank: int,
    world_size: int,
    stages: int,
    schedule: str,
    steps: int,
    batch: int,
    micro_batches: int,
    virtual_stages: int = 1,
    checkpointing: bool = False,
    blocks: int = 4,
    lr: float = 0.05,
    model: str = "gpt",
    method: str = "type:Block$",
    seed: int | None = 0,
) -> dict:
    """Train `steps` steps; each data-parallel replica takes its slice of the global batch."""
    module = pipeline.partition(
        MODELS[model](blocks),
        stages=stages,
        loss_fn=lm_loss,
        method=method,
        virtual_stages=virtual_stages,
        activation_checkpointing=checkpointing,
        seed=seed,
    )
    start = stage_params(module)
    ex = pipeline.PipelineExecutor(
        module,
        torch.optim.SGD(module.parameters(), lr=lr),
        micro_batches=micro_batches,
        schedule=schedule,
    )
    dp, d = ex.dp, module.grid.rank_in("data")
    per = batch // dp
    losses = []
    for x, y in data(steps, batch):
        losses.append(ex.train_batch(x[d * per : (d + 1) * per], y[d * per : (d + 1) * per]))
    return {
        "losses": losses,
        "start": start,
        "params": stage_params(module),
        "peak_in_flight": ex.peak_in_flight,
        "stage": module.stage,
    }
