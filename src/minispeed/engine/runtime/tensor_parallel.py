"""`deepspeed.tp_model_init` (DeepSpeed's `deepspeed.runtime.tensor_parallel` records it): the
tensor-parallel call transformers' Trainer makes when the ds_config sets
`tensor_parallel.autotp_size` > 1. Refused, naming why and what to use.

DeepSpeed 0.19.8 records the arguments there and cuts the model inside `initialize`, gathering
the output head's logits so the model's own loss sees the whole vocabulary. minispeed cuts the
model inside `initialize` too, from the same key (docs/engine/3d-parallelism.md), but its plans
leave the head's logits split by vocabulary (the loss is
`minispeed.tensor_parallel.vocab_parallel_cross_entropy(logits, targets, engine.grid)`), which a
Hugging Face model computing its own loss cannot take: it would fail in the loss with a shape
error. So the Trainer's path is refused here, before any work, instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["tp_model_init"]


def tp_model_init(
    model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any
) -> nn.Module:
    """Refused (module docstring): a model computing its own loss cannot train with minispeed's
    vocabulary-split head."""
    raise NotImplementedError(
        f"tp_model_init(tp_size={tp_size}): training a model that computes its own loss (a "
        "Hugging Face model under the Trainer) with tensor_parallel.autotp_size > 1 is not "
        "supported by minispeed: its tensor-parallel plans split the output head's vocabulary, "
        "so the loss must be minispeed.tensor_parallel.vocab_parallel_cross_entropy. Train with "
        "autotp_size 1 (ZeRO-3 partitions the parameters instead), or call initialize() on your "
        "own model with the vocab-parallel loss"
    )
