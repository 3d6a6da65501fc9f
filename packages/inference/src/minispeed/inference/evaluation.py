"""Perplexity of a language model on a token stream: how int8 weights are judged against fp32.

`perplexity = exp(mean over predicted tokens of −log p(token | the tokens before it))`. The stream
is cut into non-overlapping windows of `window + 1` tokens (the last token of one window is the
first of the next); each window predicts its last `window` tokens from the ones before, so every
token after the first is predicted exactly once, with between 0 and `window − 1` tokens of context.

Cost: `⌈(N − 1) / window⌉` sequences of `window` tokens, in forwards of `batch_size` sequences.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["perplexity"]


@torch.no_grad()
def perplexity(
    model: torch.nn.Module, tokens: torch.Tensor, window: int, batch_size: int = 16
) -> float:
    """`exp(mean NLL)` of `tokens` `(N,)` under `model` (an `InferenceGPT`, or a model whose forward
    returns logits `(B, T, V)` or a tuple starting with them, e.g. examples/gpt.py's `GPT`).

    `window` must not exceed the model's positions; a short last window is scored too.
    """
    tokens = tokens.reshape(-1).long()
    if tokens.numel() < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {tokens.numel()}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    starts = list(range(0, tokens.numel() - 1, window))
    nll, count = 0.0, 0
    for i in range(0, len(starts), batch_size):
        group = starts[i : i + batch_size]
        lengths = [min(window, tokens.numel() - 1 - s) for s in group]
        T = max(lengths)
        x = torch.zeros(len(group), T, dtype=torch.long)
        y = torch.full((len(group), T), -100, dtype=torch.long)  # -100: not scored (padding)
        for row, (s, n) in enumerate(zip(group, lengths)):
            x[row, :n], y[row, :n] = tokens[s : s + n], tokens[s + 1 : s + 1 + n]
        out = model(x)
        logits = out[0] if isinstance(out, tuple) else out
        targets = y.flatten().to(logits.device)
        nll += float(F.cross_entropy(logits.flatten(0, 1).float(), targets, reduction="sum"))
        count += sum(lengths)
    return math.exp(nll / count)
