"""What a plan can do to one module: the styles.

A plan maps module paths to one style each. Three styles replace the module by a split layer
(`Column`, `Row`, `Vocab`); the others leave it in place and change what flows through it:
`Heads` divides the head counts an attention module reshapes by, `HeadNorm` marks a norm applied
to each of this rank's heads (its replicated weight gets a partial gradient), `SequenceShard`
marks a norm that runs on sequence shards, `HeadInput` prepares the input of an output head the model
computes itself (a tied `F.linear(x, wte.weight)`), `ScatterSequence` cuts a replicated output
(position embeddings) into this rank's sequence shard.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Column",
    "HeadInput",
    "HeadNorm",
    "Heads",
    "Row",
    "ScatterSequence",
    "SequenceShard",
    "Style",
    "Vocab",
]


@dataclass(frozen=True)
class Column:
    """Replace an `nn.Linear` / `Conv1D` by a `ColumnParallelLinear`."""

    parts: int | tuple[int, ...] = 1
    """Fused parts cut separately: a count of equal parts (3 for GPT's q/k/v in one weight) or
    their proportions (`(H, KV, KV)` for Phi-3's q/k/v under grouped-query attention)."""
    gather_output: bool = False
    """All-gather the output slices (for a head whose logits must be whole)."""
    sequence_parallel: bool = False
    """The input arrives as sequence shards (all-gathered inside, Megatron-SP)."""


@dataclass(frozen=True)
class Row:
    """Replace an `nn.Linear` / `Conv1D` by a `RowParallelLinear`."""

    input_is_parallel: bool = True
    """The input is already this rank's slice (a column layer's output)."""
    sequence_parallel: bool = False
    """Reduce-scatter the output to sequence shards instead of all-reducing it."""


@dataclass(frozen=True)
class Vocab:
    """Replace an `nn.Embedding` by a `VocabParallelEmbedding`."""

    sequence_parallel: bool = False
    """Reduce-scatter the output to sequence shards instead of all-reducing it."""


@dataclass(frozen=True)
class Heads:
    """Divide an attention module's integer attributes (head counts, split sizes) by n."""

    attrs: tuple[str, ...]
    """Attribute names, e.g. `("n_head",)`; each must exist and be divisible by n. A dotted
    name (`"config.num_attention_heads"`: Phi-3's attention reads its q width from the config)
    divides the attribute of a shallow copy of that object given to this module alone, so the
    model's own config stays whole (and a later change to it does not reach the copy)."""
    per_head_kwargs: tuple[str, ...] = ()
    """Keyword arguments of the module holding one slice per head of all the model's heads,
    laid out `(B·H, ...)` (Bloom's ALiBi biases, built by the model for its H heads): a forward
    pre-hook keeps this rank's heads `[r·H/n, (r+1)·H/n)` (the first attribute's count, divided,
    is `H/n`), so each head keeps its own slope. A copy of `e·B·H/n·T` bytes, no
    communication."""


@dataclass(frozen=True)
class HeadNorm:
    """A norm over one head's features (Qwen3's `q_norm` / `k_norm`, weight `(d,)`) applied to this
    rank's heads after a column split: the forward is local, but its replicated weight sees only
    `H/n` heads, so its gradient is a partial sum, all-reduced in backward (one all-reduce of its
    `e·d` bytes per parameter)."""


@dataclass(frozen=True)
class SequenceShard:
    """A module (a norm, a dropout) that runs on sequence shards under sequence parallelism: its
    replicated parameters get partial gradients, summed by one all-reduce each in backward."""


@dataclass(frozen=True)
class HeadInput:
    """The module's output feeds a vocabulary-parallel head that the model applies itself (GPT's
    tied `F.linear(x, wte.weight)`): identity forward, all-reduce of the gradient in backward; with
    `sequence_parallel`, its sequence shards are all-gathered (reduce-scatter in backward) and its
    own parameters are treated as by `SequenceShard`."""

    sequence_parallel: bool = False


@dataclass(frozen=True)
class ScatterSequence:
    """The module's output is replicated and added to sequence shards (position embeddings): keep
    this rank's sequence shard; backward all-gathers the gradient, so it is whole everywhere."""


Style = Column | Row | Vocab | Heads | HeadNorm | SequenceShard | HeadInput | ScatterSequence
