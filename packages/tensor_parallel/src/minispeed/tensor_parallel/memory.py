"""Activation bytes a transformer block keeps for backward, per rank: the formula and the meter.

For minispeed's GPT block (pre-norm, no dropout; `B` sequences of `T` tokens, width `C`, `H`
heads, `e` bytes per element, `n` tensor-parallel ranks), what autograd saves is:

| tensor | elements | under TP | under TP + SP |
|---|---|---|---|
| LayerNorm 1 and 2: input and output (the output is the column layer's input) | 4·BTC | whole | /n |
| LayerNorm statistics (mean, rstd) | 4·BT | whole | /n |
| q, k, v (one `qkv` output) | 3·BTC | /n | /n |
| attention output (also the row layer's input: a view, not a copy) | BTC | /n | /n |
| attention log-sum-exp | BTH | /n | /n |
| MLP: GeLU input and output | 8·BTC | /n | /n |

So `e·(4·BTC + 4·BT) + e·(12·BTC + BTH)/n` under tensor parallelism, and all of it divided by n
under sequence parallelism (`e·(16·BTC + 4·BT + BTH)/n`): the norms run on sequence shards and
the column layers keep their input as shards (gathering it again in backward). This is
Megatron-SP's point: tensor parallelism alone leaves `4·BTC + 4·BT` per block replicated.

`saved_activation_bytes` measures the same thing: the distinct storages autograd saves while a
function runs, parameters excluded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["block_activation_bytes", "saved_activation_bytes"]


def block_activation_bytes(
    B: int, T: int, C: int, H: int, n: int, sequence_parallel: bool = False, e: int = 4
) -> int:
    """Bytes one GPT block saves for backward on each of `n` ranks (see the module docstring)."""
    replicated = 4 * B * T * C + 4 * B * T  # the norms' inputs, outputs and statistics
    split = 12 * B * T * C + B * T * H  # q/k/v, attention output and lse, the MLP's hidden layer
    if sequence_parallel:
        return e * (replicated + split) // n
    return e * replicated + e * split // n


def saved_activation_bytes(fn: Callable[[], Any], module: nn.Module) -> tuple[Any, int]:
    """`(fn(), bytes)`: the bytes of the distinct storages autograd saved for backward while `fn`
    ran, not counting `module`'s parameters (which exist anyway)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved.values())
