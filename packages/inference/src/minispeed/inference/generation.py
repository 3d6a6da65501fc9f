"""Text generation: sampling settings, one sampler, and a generate loop with or without a KV cache.

With the cache, each prompt is prefilled once and every new token costs one decode step over all
live sequences (attention reads the cache: O(L) per token). Without it, every new token recomputes
the whole sequence (O(L²) attention and L times the matmuls): the naive version the cached one must
match token for token.

Note [sampling draws one uniform per token]: each sequence has its own generator seeded with
`seed + index`, and the sampler draws exactly one uniform per token (inverse CDF), so the tokens
of a sequence do not depend on how many other sequences run beside it, nor on whether the logits
came from the cache or a full recomputation (they agree to fp32 rounding).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from minispeed.core import ranges
from minispeed.inference import kernels
from minispeed.inference.fused_gpt import InferenceGPT

__all__ = ["SamplingConfig", "as_prompt_lists", "generate", "prompt_error", "sample_next"]


@dataclass(frozen=True)
class SamplingConfig:
    """How to pick each next token, and when to stop."""

    max_new_tokens: int = 16
    """Tokens to generate per sequence at most."""
    temperature: float = 0.0
    """0 is greedy (argmax); otherwise logits are divided by it before the softmax."""
    top_k: int | None = None
    """Keep only the k most likely tokens (None: all)."""
    top_p: float | None = None
    """Keep the smallest set of most likely tokens whose probability reaches top_p (None: all)."""
    stop_tokens: tuple[int, ...] = ()
    """A sequence ends after emitting one of these (the stop token is included in its output)."""
    seed: int = 0
    """Sequence i samples with a generator seeded seed + i."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p}")


def prompt_error(prompt: list[int], vocab_size: int | None) -> str | None:
    """Why `prompt` cannot be fed to a model of `vocab_size` tokens, or None if it can.

    Checks it is non-empty and that every entry is an int in [0, vocab_size) (any int when
    `vocab_size` is None): an id outside the vocabulary would otherwise surface as an
    `IndexError` deep inside the embedding.
    """
    if len(prompt) == 0:
        return "empty prompt: give at least one token"
    for at, token in enumerate(prompt):
        try:
            if isinstance(token, bool):
                raise TypeError
            token = operator.index(token)  # ints, numpy and 0-d integer tensors
        except TypeError:
            return f"token at position {at} is {token!r}, not an int: pass token ids"
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            return (
                f"token id {token} at position {at} is outside the vocabulary [0, {vocab_size}): "
                "check the tokenizer matches the model"
            )
    return None


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator) -> int:
    """One token id from `logits` `(V,)` (see Note [sampling draws one uniform per token])."""
    if cfg.temperature == 0:
        return int(kernels.argmax(logits))
    logits = logits.float() / cfg.temperature
    if cfg.top_k is not None:
        kth = torch.topk(logits, min(cfg.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p is not None:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass of the more likely tokens
        sorted_p = sorted_p.masked_fill(before >= cfg.top_p, 0.0)  # the first token always stays
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp(max=probs.numel() - 1))


def as_prompt_lists(prompts: object) -> list[list[int]]:
    """`prompts` as lists of token ids: a list of lists (or of 1-D tensors), or a `(B, T)`
    integer tensor such as Hugging Face's `input_ids` (every row is a whole prompt: no padding).
    """
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.is_floating_point() or prompts.is_complex():
            raise ValueError(
                "prompts given as a tensor must be a (B, T) tensor of integer token ids (like "
                f"input_ids), got shape {tuple(prompts.shape)} and {prompts.dtype}: for one "
                "prompt pass ids[None]"
            )
        return prompts.tolist()
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a list of prompts (lists of token ids) or a (B, T) tensor, got "
            f"{type(prompts).__name__}"
        )
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            if p.dim() != 1:
                raise ValueError(f"prompt {i} is a tensor of shape {tuple(p.shape)}: give 1-D ids")
            p = p.tolist()
        elif not isinstance(p, (list, tuple)):
            raise ValueError(
                f"prompt {i} is {p!r}, not a list of token ids: prompts look like a flat list of "
                "token ids: wrap it, generate(model, [prompt], cfg)"
            )
        out.append(list(p))
    return out


def _vocab_size(model: torch.nn.Module) -> int | None:
    if isinstance(model, InferenceGPT):
        return model.vocab_size
    return getattr(getattr(model, "cfg", None), "vocab_size", None)


def _full_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Last-position logits `(V,)` from a full forward (InferenceGPT or the original GPT)."""
    out = model(torch.tensor([tokens]))
    logits = out[0] if isinstance(out, tuple) else out  # GPT returns (logits, loss)
    return logits[0, -1]


def generate(
    model: torch.nn.Module,
    prompts: list[list[int]] | torch.Tensor,
    cfg: SamplingConfig,
    use_cache: bool = True,
    kv_block_size: int = 16,
    kv_num_blocks: int | None = None,
) -> list[list[int]]:
    """New tokens for each prompt. `use_cache=True` needs an `InferenceGPT` (see init_inference).

    `prompts`: lists of token ids, or a `(B, T)` integer tensor (see `as_prompt_lists`); an
    empty batch gives `[]`. Returns the new tokens only, as lists. The cache pool defaults to
    exactly what the prompts and `max_new_tokens` need; a smaller `kv_num_blocks` that cannot
    hold them raises before any work starts, as do token ids outside the vocabulary.
    """
    prompts = as_prompt_lists(prompts)
    sizes = {"kv_block_size": kv_block_size}
    if kv_num_blocks is not None:
        sizes["kv_num_blocks"] = kv_num_blocks
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not prompts:
        return []
    block_size = model.block_size if isinstance(model, InferenceGPT) else model.cfg.block_size
    vocab_size = _vocab_size(model)
    for i, p in enumerate(prompts):
        error = prompt_error(p, vocab_size)
        if error:
            raise ValueError(f"prompt {i}: {error}")
        if len(p) + cfg.max_new_tokens > block_size:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens + max_new_tokens {cfg.max_new_tokens} > the "
                f"model's {block_size} positions: shorten the prompt or lower max_new_tokens"
            )
    gens = [torch.Generator().manual_seed(cfg.seed + i) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    if cfg.max_new_tokens == 0:
        return outputs
    with torch.no_grad():
        if not use_cache:
            return _generate_recompute(model, prompts, cfg, gens, outputs)
        if not isinstance(model, InferenceGPT):
            raise TypeError(
                "use_cache=True needs the model returned by init_inference; pass use_cache=False "
                f"to generate with a plain {type(model).__name__}"
            )
        per_seq = [-(-(len(p) + cfg.max_new_tokens) // kv_block_size) for p in prompts]
        need = sum(per_seq)
        num_blocks = need if kv_num_blocks is None else kv_num_blocks
        if need > num_blocks:
            raise ValueError(
                f"the prompts and max_new_tokens need {need} KV blocks of {kv_block_size} tokens "
                f"but the cache has {num_blocks}: raise kv_num_blocks or send fewer/shorter prompts"
            )
        return _generate_cached(model, prompts, cfg, gens, outputs, num_blocks, kv_block_size)


def _done(cfg: SamplingConfig, out: list[int]) -> bool:
    return len(out) >= cfg.max_new_tokens or (bool(out) and out[-1] in cfg.stop_tokens)


def _generate_recompute(model, prompts, cfg, gens, outputs):
    for i, p in enumerate(prompts):
        while not _done(cfg, outputs[i]):
            with ranges.range("inference.recompute"):
                logits = _full_logits(model, p + outputs[i])
            outputs[i].append(sample_next(logits, cfg, gens[i]))
    return outputs


def _generate_cached(model, prompts, cfg, gens, outputs, num_blocks, kv_block_size):
    cache = model.new_cache(num_blocks, kv_block_size)
    by_length: dict[int, list[int]] = {}  # prompts of one length are prefilled in one forward
    for i, p in enumerate(prompts):
        cache.add_sequence(i)
        by_length.setdefault(len(p), []).append(i)
    for ids in by_length.values():
        with ranges.range("inference.prefill"):
            logits = model.prefill_many(
                torch.tensor([prompts[i] for i in ids]), cache, ids, last_only=True
            )  # (B, 1, V)
        for row, i in enumerate(ids):
            outputs[i].append(sample_next(logits[row, -1], cfg, gens[i]))
    live = [i for i in range(len(prompts)) if not _done(cfg, outputs[i])]
    while live:
        with ranges.range("inference.decode"):
            logits = model.decode(torch.tensor([outputs[i][-1] for i in live]), cache, live)
        with ranges.range("inference.sample"):
            if cfg.temperature == 0:  # greedy: one argmax for the batch, one list out
                for i, token in zip(live, kernels.argmax(logits).tolist()):
                    outputs[i].append(token)
            else:
                for row, i in enumerate(live):
                    outputs[i].append(sample_next(logits[row], cfg, gens[i]))
        finished = [i for i in live if _done(cfg, outputs[i])]
        for i in finished:
            cache.free(i)  # its blocks serve no one else in this call, but the pool stays honest
        if finished:
            live = [i for i in live if i not in finished]
    return outputs
