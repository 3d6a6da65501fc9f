"""A small GPT, written to be read: the model the demo trains with ZeRO-3.

The architecture is the GPT-2 recipe at toy scale (after nanoGPT): token and position embeddings,
``n_layer`` pre-LayerNorm transformer blocks (causal self-attention, then a 4x-wide GELU MLP, each
on a residual branch), a final LayerNorm, and an output projection tied to the token embedding.

Parameter count (biases and LayerNorms included), with V = vocab_size, T = block_size,
C = n_embd, L = n_layer::

    Ψ = V·C + T·C                    # token + position embeddings (the output head reuses wte)
      + L · (12·C² + 13·C)           # per block: qkv 3C²+3C, proj C²+C, mlp 8C²+5C, two LNs 4C
      + 2·C                          # final LayerNorm

:meth:`GPT.num_params` counts the same number from the module, so docs, the ZeRO memory estimator
and this formula can be checked against each other.

Note [tied output head]: the logits are ``x @ wte.weight.T``, computed with ``F.linear`` on the
embedding's own weight inside ``GPT.forward``, rather than by assigning one ``nn.Parameter`` to two
modules. Each parameter then belongs to exactly one module, which keeps ZeRO-3's per-module
gather/release hooks simple (the embedding's weight is read twice in one forward, which stage 3
must handle anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. Every field is a size; nothing here depends on the data or the run."""

    vocab_size: int
    """Distinct tokens (characters for the demo's tokenizer)."""
    block_size: int = 64
    """Longest context the model attends over, in tokens (also the number of position embeddings)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream, C."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches (0 keeps runs deterministic)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                "pick n_head among the divisors of n_embd"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    def num_params(self) -> int:
        """Parameter count Ψ by the formula in the module docstring (tied head counted once)."""
        V, T, C, L = self.vocab_size, self.block_size, self.n_embd, self.n_layer
        return V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t only sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k and v in one matmul
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes are read from qkv's output, not from x: under tensor parallelism (see
        # minispeed.tensor_parallel) qkv yields n_head/n heads, and under sequence parallelism x is
        # a sequence shard while qkv's output covers the whole sequence.
        qkv = self.qkv(x)  # (B, T, 3C)
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)  # each (B, T, C)
        # (B, T, C) -> (B, n_head, T, head_dim): heads attend independently.
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # heads side by side again
        return F.dropout(self.proj(y), p, self.training)


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C -> C with a GELU in between."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """One transformer block: x + attn(ln(x)), then x + mlp(ln(x)) (pre-norm residuals)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """The language model: token ids (B, T) -> next-token logits (B, T, V), and the loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(
            cfg.vocab_size, cfg.n_embd
        )  # also the output head: Note [tied output head]
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.apply(self._init_weights)
        # GPT-2: scale the init of each residual branch's last projection by 1/sqrt(2L), so the
        # residual stream's variance does not grow with depth (2 branches per block).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters in the module, each counted once (the tied head adds nothing)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) for token ids ``idx`` (B, T), and the mean cross-entropy when
        ``targets`` (B, T) is given (else ``None``)."""
        seq_len = idx.shape[1]  # T
        if seq_len > self.cfg.block_size:
            raise ValueError(
                f"sequence length {seq_len} exceeds block_size {self.cfg.block_size}; "
                "crop the context or build the model with a larger block_size"
            )
        pos = torch.arange(seq_len, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C) + (T, C) broadcast over the batch
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight)  # (B, T, V): the tied head, Note [tied output head]
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T); returns (B, T + new).

        ``temperature == 0`` picks the most likely token (greedy); otherwise tokens are sampled
        from softmax(logits / temperature), restricted to the ``top_k`` most likely when given.
        Each new token costs one full forward over the (cropped) context: there is no KV cache.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.block_size :]  # the model only sees block_size tokens
            logits, _ = self(context)
            logits = logits[:, -1, :]  # (B, V): the prediction for the next position
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat([idx, next_id], dim=1)
        return idx
