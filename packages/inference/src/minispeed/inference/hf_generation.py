"""transformers' `model.generate(...)`, answered by the fused model where the call allows it.

DeepSpeed's `init_inference` hands back an engine whose `generate` is the Hugging Face model's
own, running on the injected kernels. minispeed's fused model is a separate module sharing the
weights, so `hf_generate` reads the call as transformers would (the model's `generation_config`
updated by the keyword arguments). Greedy decoding with no logits processor, the common case,
runs on the fused model and its paged KV cache; any other call (sampling, beams, penalties,
streamers, scores, stop strings) goes to the Hugging Face model's own `generate`, eager, with
transformers' exact semantics. `fused_refusal` names why a call went there.

The result is transformers': a `(B, T + n)` tensor of the prompt (its left padding kept) and the
new tokens; a row that emits an end-of-sequence id is filled with `pad_token_id` after it, and
decoding stops once every row has (so n ≤ `max_new_tokens`). Costs: those of
`minispeed.inference.generate` (one prefill per prompt, then one decode step per token for the
batch; the cache holds 2·L·(T + n)·d fp32 values per sequence).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from minispeed.inference.generation import SamplingConfig, generate

__all__ = ["fused_refusal", "hf_generate"]

# Settings that leave greedy decoding greedy and need no logits processor: the only ones a
# call may change from transformers' defaults and still run on the fused model.
_NEUTRAL = {
    "max_new_tokens", "max_length", "pad_token_id", "eos_token_id", "bos_token_id",
    "decoder_start_token_id", "use_cache", "do_sample", "num_beams", "num_return_sequences",
    "output_attentions", "output_hidden_states", "output_scores", "output_logits",
    "return_dict_in_generate", "temperature", "top_k", "top_p", "_from_model_config",
    "transformers_version",
}  # fmt: skip
# Of those, the values that keep it so (temperature / top_k / top_p are unused without sampling).
_MUST_BE = {
    "do_sample": (False, None),
    "num_beams": (1, None),
    "num_return_sequences": (1, None),
    "output_attentions": (False, None),
    "output_hidden_states": (False, None),
    "output_scores": (False, None),
    "output_logits": (False, None),
    "return_dict_in_generate": (False, None),
}


def _plan(
    fused: nn.Module, hf_model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | tuple[torch.Tensor, list[list[int]], int, tuple[int, ...], int | None]:
    """Why the call `generate(*args, **kwargs)` cannot run fused (a str), or (input_ids, prompts,
    max_new_tokens, eos ids, pad id)."""
    kwargs = dict(kwargs)
    input_ids = args[0] if args else kwargs.pop("input_ids", None)
    if len(args) > 1:
        return "positional arguments after input_ids"
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return "input_ids is not a (B, T) tensor"
    if input_ids.is_floating_point() or input_ids.numel() == 0:
        return "input_ids holds no token ids"
    mask = kwargs.pop("attention_mask", None)
    base = kwargs.pop("generation_config", None) or getattr(hf_model, "generation_config", None)
    if base is None:
        return "the model has no generation_config"
    config = copy.deepcopy(base)
    unused = config.update(**kwargs)
    if unused:
        return f"generate arguments {sorted(unused)} need transformers' own loop"
    changed = set(config.to_diff_dict())
    other = sorted(changed - _NEUTRAL)
    if other:
        return f"generation settings {other} need a logits processor or another decoding"
    for name, allowed in _MUST_BE.items():
        if getattr(config, name, None) not in allowed:
            return f"{name}={getattr(config, name)!r} is not greedy decoding of one sequence"
    eos = config.eos_token_id
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    t = input_ids.shape[1]
    new = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - t
    if mask is None:
        if pad is not None and pad not in eos and bool((input_ids == pad).any()):
            return "input_ids holds the pad token and no attention_mask says where the prompts are"
        prompts = input_ids.tolist()
    else:
        mask = torch.as_tensor(mask).bool()
        if mask.shape != input_ids.shape:
            return "attention_mask's shape is not input_ids'"
        # left padding only: each row's ones are one run that ends at the last column
        if bool((mask[:, 1:].int() - mask[:, :-1].int()).lt(0).any()) or not bool(
            mask[:, -1].all()
        ):
            return "attention_mask is not left padding"
        prompts = [row[keep].tolist() for row, keep in zip(input_ids, mask)]
        if any(len(p) == 0 for p in prompts):
            return "a row of attention_mask is all zeros"
    if max(len(p) for p in prompts) + max(new, 0) > getattr(fused, "block_size", 0):
        return "the prompt plus max_new_tokens is longer than the model's positions"
    return input_ids, prompts, max(new, 0), eos, pad


def fused_refusal(fused: nn.Module, hf_model: nn.Module, *args: Any, **kwargs: Any) -> str | None:
    """Why `hf_generate` would hand this call to transformers' own `generate` (None: it runs on
    the fused model)."""
    plan = _plan(fused, hf_model, args, kwargs)
    return plan if isinstance(plan, str) else None


def hf_generate(fused: nn.Module, hf_model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`hf_model.generate(*args, **kwargs)`'s result, computed on `fused` (an `InferenceGPT`
    built from `hf_model` by `init_inference`) when `fused_refusal` finds nothing against it,
    else by `hf_model.generate` itself (see the module docstring)."""
    plan = _plan(fused, hf_model, args, kwargs)
    if isinstance(plan, str):
        return hf_model.generate(*args, **kwargs)
    input_ids, prompts, max_new, eos, pad = plan
    if max_new == 0:
        return input_ids
    with torch.no_grad():
        new = generate(fused, prompts, SamplingConfig(max_new_tokens=max_new, stop_tokens=eos))
    steps = max(len(r) for r in new)
    b, t = input_ids.shape
    out = input_ids.new_full((b, t + steps), 0 if pad is None else pad)
    out[:, :t] = input_ids
    for i, row in enumerate(new):
        out[i, t : t + len(row)] = torch.tensor(row, dtype=out.dtype)
    return out
