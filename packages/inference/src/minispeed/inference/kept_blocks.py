"""Blocks no policy fused, run the way their own model runs them (the full forward only).

`InferenceGPT` calls a kept block as `block(x)`. minispeed's `Block` needs nothing more, but a
Hugging Face decoder layer receives from its model what the layer cannot make itself: the
causal attention mask (without it, `attn_implementation="eager"` attends to future positions;
SDPA infers causality only when no mask is given) and, for LLaMA, the rotary embeddings
`(cos, sin)` of the positions. `KeptHFBlock` passes both, built the way `LlamaModel` /
`GPT2Model` build them for a batch without padding, so a kept block computes what it computes
inside transformers.

Cost per kept block and forward: a (T, T) additive mask (T² floats, broadcast over the batch)
and, for LLaMA, one call of the model's rotary module (O(B·T·D)).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["KeptHFBlock"]


class KeptHFBlock(nn.Module):
    """A Hugging Face decoder layer kept as it is, given its causal mask (and rotary tables).

    `rotary`: the model's rotary module (`LlamaModel.rotary_emb`, shared, not copied) or None
    for learned positions (GPT-2). `why_kept` says why no policy fused it (in the report, and in
    the error of the cached paths, which need fused blocks).
    """

    def __init__(self, layer: nn.Module, why_kept: str, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.layer, self.rotary, self.why_kept = layer, rotary, why_kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `(B, T, C)` at positions 0 .. T-1 -> `(B, T, C)`."""
        B, T, _ = x.shape
        # Additive causal mask (B, 1, T, T): the finite minimum, as transformers uses, so a row
        # never becomes all -inf.
        blocked = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        mask = torch.zeros(T, T, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill(blocked, torch.finfo(x.dtype).min).expand(B, 1, T, T)
        kwargs = {}
        if self.rotary is not None:
            positions = torch.arange(T, device=x.device)[None].expand(B, T)
            kwargs = {"position_ids": positions, "position_embeddings": self.rotary(x, positions)}
        out = self.layer(x, attention_mask=mask, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # older transformers return tuples
