"""Ulysses sequence parallelism for Hugging Face models (ALST's training path): the attention
registered with transformers, the data loader that cuts each batch's sequence over the group,
and the loss averaged over the group by counted tokens.

P ranks of a sequence-parallel group train on one sequence together: each holds T/P of its
tokens through the whole model (embeddings, norms, MLPs, the head and the loss are per token),
and attention, which needs every token, trades the sequence split for a head split
(`ulysses.seq_all_to_all`) around whatever attention the model was loaded with:

```python
import minispeed.tensor_parallel as tp

model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
tp.register_ulysses_attention("sdpa", group, model.config)   # transformers now calls Ulysses
for batch in tp.SequenceShardLoader(loader, group):          # T/P tokens of every batch in turn
    out = model(**batch)                                     # input_ids, position_ids, shift_labels
    loss = model.loss_function(logits=out.logits, labels=None,
                               shift_labels=batch["shift_labels"], vocab_size=V)
    loss = tp.sequence_parallel_mean(loss, (batch["shift_labels"] != -100).sum(), group)
    loss.backward()    # exact once gradients are averaged over the group (see Loss)
```

**Attention** (`UlyssesAttention`, transformers' attention-interface signature `(module, query,
key, value, attention_mask, **kwargs)`, q/k/v `(B, H, T/P, D)`): 3 `seq_all_to_all` in
(q, k, v: scatter heads, gather the sequence), the model's own attention on `(B, H/P, T, D)`,
1 back (its `(B, T, H/P, D)` output: scatter the sequence, gather heads). Bytes sent per rank
and layer, forward: (P-1)/P · B·(T/P)·D·b·(2H + 2H_kv') with H_kv' = max(H_kv, P) (key/value
heads fewer than P are repeated up to P first), and as much again in backward; plus one
all-gather of the position ids, (P-1)·B·(T/P)·8. The mask transformers made for T/P tokens is
dropped: attention is causal over the whole sequence (`is_causal`), as DeepSpeed's is (a padded
or packed batch needs an attention that reads `position_ids`, such as flash-attention's).

**Data** (`SequenceShardLoader`): every rank reads its own batches; each step all-gathers the P
ranks' batches (`comm.all_gather_object`: P × one batch's bytes, pickled) and yields them in
turn, this rank's T/P slice of each: P micro-steps train on P sequences, as P data-parallel
ranks would in one. Labels become `shift_labels` (labels moved left by one, -100 at the end)
before cutting, so the last token of each slice still has its target (the next slice's first).
Lengths may differ between ranks and steps; each must divide by P.

**Loss** (`sequence_parallel_mean`): Σ_r loss_r·n_r / Σ_r n_r over the group (n_r the tokens
rank r counts; a rank with none adds 0, not NaN), the whole sequence's mean; one differentiable
all-reduce of a scalar each way (the Trainer's all-gather of the losses does the same). Its
backward gives each rank P × its share of the whole sequence's gradient, so the gradients are
exact once *averaged* over the group: ZeRO-3's reduce-scatter in DeepSpeed's engine and
minispeed's, or by hand. Stages 0-2 of both engines *sum* the sequence ranks' gradients
(docs/engine/deepspeed-compat.md, DeepSpeed-Ulysses), which gives P × the whole-sequence
gradient there: harmless with gradient clipping and Adam (the Trainer's default), otherwise
divide this loss by P at those stages.

transformers is imported only inside `register_ulysses_attention`. See `docs/architecture.md`
(tensor_parallel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

import minispeed.comm as comm
from minispeed.tensor_parallel.group import TensorGroup
from minispeed.tensor_parallel.mappings import copy_to_parallel, reduce_from_parallel
from minispeed.tensor_parallel.ulysses import seq_all_to_all

__all__ = [
    "SequenceShardLoader",
    "UlyssesAttention",
    "register_ulysses_attention",
    "sequence_parallel_mean",
    "shard_batch",
    "unregister_ulysses_attention",
]

#: Attention implementations that need a 4-D mask over the whole sequence (T² memory): refused.
MASKED_ONLY = ("eager", "paged|eager")


def check_heads(num_heads: int, num_kv_heads: int, p: int) -> None:
    """Refuse head counts Ulysses cannot split over `p` ranks, naming the fix."""
    if num_heads % p:
        raise ValueError(
            f"Ulysses sequence parallelism splits the {num_heads} attention heads over "
            f"{p} ranks: choose a sequence-parallel size that divides {num_heads}"
        )
    if num_kv_heads % p and p % num_kv_heads:
        raise ValueError(
            f"the {num_kv_heads} key/value heads and the sequence-parallel size {p} must divide "
            "one another (each rank takes an equal share of them, or each of them is repeated "
            "to an equal number of ranks)"
        )


class UlyssesAttention:
    """transformers' attention interface run over a sequence split across `group` (module
    docstring): `__call__(module, query, key, value, attention_mask, *args, **kwargs)` with
    q `(B, H, T/P, D)`, k and v `(B, H_kv, T/P, D)`, returns `((B, T/P, H, D), weights)` as the
    `core` attention does for the whole sequence. `disable_in_eval`: in eval mode (`module.
    training` false) call `core` on this rank's tokens alone, with the mask."""

    def __init__(
        self,
        core: Callable[..., tuple[torch.Tensor, Any]],
        group: Any,
        *,
        num_heads: int,
        num_kv_heads: int,
        disable_in_eval: bool = False,
    ) -> None:
        self.core, self.group, self.disable_in_eval = core, group, disable_in_eval
        self.size = comm.get_world_size(group)
        check_heads(num_heads, num_kv_heads, self.size)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.kv_repeat = max(1, self.size // num_kv_heads)

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if self.disable_in_eval and not module.training:
            return self.core(module, query, key, value, attention_mask, *args, **kwargs)
        if (
            query.dim() != 4
            or query.shape[1] != self.num_heads
            or key.shape[1] != self.num_kv_heads
        ):
            raise ValueError(
                f"UlyssesAttention expects query (B, {self.num_heads}, T/P, D) and key/value "
                f"(B, {self.num_kv_heads}, T/P, D) (transformers' layout), got "
                f"{tuple(query.shape)} and {tuple(key.shape)}"
            )
        if self.kv_repeat > 1:  # fewer key/value heads than ranks: one (repeated) per rank
            key = key.repeat_interleave(self.kv_repeat, dim=1)
            value = value.repeat_interleave(self.kv_repeat, dim=1)
        q, k, v = (seq_all_to_all(t, self.group, 1, 2) for t in (query, key, value))
        if kwargs.get("position_ids") is not None:  # the whole sequence's, for the core
            kwargs["position_ids"] = _gather_along_1(kwargs["position_ids"], self.group)
        groups = q.shape[1] // k.shape[1]
        before = getattr(module, "num_key_value_groups", groups)
        module.num_key_value_groups = groups  # the local heads' ratio (differs when repeated)
        try:
            out, weights = self.core(module, q, k, v, None, *args, **kwargs)  # (B, T, H/P, D)
        finally:
            module.num_key_value_groups = before
        return seq_all_to_all(out, self.group, 1, 2), weights  # (B, T/P, H, D)


def _gather_along_1(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's `x` `(B, t, ...)` concatenated along dim 1 in rank order (not differentiable:
    for indices)."""
    p = comm.get_world_size(group)
    out = torch.empty((p, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.movedim(0, 1).flatten(1, 2)


_REGISTERED: dict[str, UlyssesAttention] = {}


def register_ulysses_attention(
    implementation: str, group: Any, config: Any, *, disable_in_eval: bool = False
) -> UlyssesAttention:
    """Make transformers' attention `implementation` (`"sdpa"`, `"flash_attention_2"`,
    `"flex_attention"`, ...) run as `UlyssesAttention` over `group` for models of `config`
    (its text config's head counts). The model keeps its `attn_implementation`, so every
    transformers branch on that name still runs; only the call is replaced. Registering again
    wraps the original attention, never the previous wrapper; `unregister_ulysses_attention`
    puts the original back."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation in MASKED_ONLY:
        raise ValueError(
            f"attn_implementation {implementation!r} needs a 4-D mask over the whole sequence "
            "(T² memory), which Ulysses drops: load the model with 'sdpa', 'flex_attention' or "
            "a flash-attention implementation"
        )
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"{implementation!r} is not an attention implementation transformers knows; choose "
            f"one of {sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}"
        )
    current = ALL_ATTENTION_FUNCTIONS[implementation]
    core = current.core if isinstance(current, UlyssesAttention) else current
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    wrapper = UlyssesAttention(
        core, group, num_heads=heads, num_kv_heads=kv, disable_in_eval=disable_in_eval
    )
    ALL_ATTENTION_FUNCTIONS[implementation] = wrapper
    _REGISTERED[implementation] = wrapper
    return wrapper


def unregister_ulysses_attention(implementation: str) -> None:
    """Put transformers' own `implementation` back (nothing if it was not registered)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    wrapper = _REGISTERED.pop(implementation, None)
    if wrapper is not None:
        ALL_ATTENTION_FUNCTIONS[implementation] = wrapper.core


def shard_batch(batch: dict[str, Any], rank: int, size: int) -> dict[str, Any]:
    """This rank's slice of one batch (module docstring): `labels` turned into `shift_labels`,
    `position_ids` made (0..T-1 per row) when absent, then every `(B, T, ...)` tensor cut to
    tokens [rank·T/P, (rank+1)·T/P); other values unchanged."""
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(
            "a sequence-parallel batch needs 'input_ids' of shape (B, T); got "
            f"{None if ids is None else getattr(ids, 'shape', type(ids).__name__)}"
        )
    b, t = ids.shape
    if t % size:
        raise ValueError(
            f"the batch's sequence length {t} is not divisible by the sequence-parallel size "
            f"{size}: pad every batch to a multiple of {size} (a data collator's "
            f"pad_to_multiple_of={size})"
        )
    batch = dict(batch)
    if "labels" in batch and "shift_labels" not in batch:
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    if batch.get("position_ids") is None:
        batch["position_ids"] = torch.arange(t, device=ids.device).expand(b, t)
    chunk = t // size
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            if value.dim() < 2 or value.shape[1] != t:
                raise ValueError(
                    f"batch[{key!r}] has shape {tuple(value.shape)}: every tensor of a "
                    f"sequence-parallel batch must be (B, T={t}, ...) to be cut along the sequence"
                )
            value = value[:, rank * chunk : (rank + 1) * chunk].contiguous()
        out[key] = value
    return out


class SequenceShardLoader:
    """Wrap a data loader for Ulysses (module docstring): each step gathers the group's batches
    and yields them one after the other, this rank's slice of each (`shard_batch`), moved to
    `device` when given. `len()` is P × the loader's. Every rank of `group` must iterate it in
    step; loaders giving different numbers of batches are an error on every rank, not a hang."""

    def __init__(self, loader: Iterable, group: Any, *, device: Any = None) -> None:
        self.loader, self.group, self.device = loader, group, device
        self.rank, self.size = comm.get_rank(group), comm.get_world_size(group)

    def __len__(self) -> int:
        return len(self.loader) * self.size  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = iter(self.loader)
        while True:
            mine = next(batches, None)
            if mine is not None:
                mine = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in mine.items()}
            everyone = comm.all_gather_object(mine, group=self.group)
            if all(b is None for b in everyone):
                return
            if any(b is None for b in everyone):
                ended = [r for r, b in enumerate(everyone) if b is None]
                raise RuntimeError(
                    f"SequenceShardLoader: the loaders of sequence-parallel ranks {ended} ended "
                    "while the others still gave batches; every rank of the group must read as "
                    "many batches (a DistributedSampler with drop_last, or equal datasets)"
                )
            for batch in everyone:
                part = shard_batch(batch, self.rank, self.size)
                if self.device is not None:
                    part = {
                        k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                        for k, v in part.items()
                    }
                yield part


def sequence_parallel_mean(
    loss: torch.Tensor, count: torch.Tensor | int, group: Any
) -> torch.Tensor:
    """The mean over the whole sequence from each rank's mean `loss` over its `count` tokens:
    Σ_r loss_r·n_r / max(Σ_r n_r, 1) over `group`, differentiable (module docstring). Two
    all-reduces of one element."""
    tg = TensorGroup.of(group)
    n = torch.as_tensor(count, device=loss.device).to(loss.dtype).detach()
    weighted = torch.where(n > 0, loss, torch.zeros_like(loss)) * n
    total = reduce_from_parallel(copy_to_parallel(weighted, tg).clone(), tg)  # a scalar
    tokens = n.clone().reshape(1)
    comm.all_reduce(tokens, group=tg.group)
    return total / tokens.reshape(()).clamp(min=1)
