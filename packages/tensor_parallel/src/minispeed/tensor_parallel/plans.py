"""Ready plans: minispeed's GPT (examples/gpt.py), Hugging Face GPT-2 and LLaMA.

Each splits every block the Megatron way (attention: q/k/v column-parallel by heads, output
projection row-parallel; MLP: up column-parallel, down row-parallel), the token embedding by
vocabulary and the output head by vocabulary, so the logits come out as each rank's `(B, T, V/n)`
slice: compute the loss with `vocab_parallel_cross_entropy` (the full logits never exist).

| model | attention | head | sequence parallel |
|---|---|---|---|
| `gpt_plan` | fused `qkv` (3 parts), `n_head` divided | tied `F.linear(x, wte.weight)` in the model: `ln_f`'s output is prepared for it (`HeadInput`) | yes |
| `gpt2_plan` | `Conv1D` `c_attn` (3 parts, weight `(C, 3C)`), `num_heads` and `split_size` divided | `lm_head`, tied to `wte`: split alike, one slice | no (refused) |
| `llama_plan` | `q_proj` by heads, `k_proj`/`v_proj` by kv heads (GQA: head h reads kv head `h // (H/KV)`, and both ranges are cut at the same place) | `lm_head` (tied or not) | no (refused) |

Hugging Face's attention and mask code reshape by the input's sequence length, which sequence
shards would change: sequence parallelism is offered for minispeed's GPT only, whose attention
reads the sequence length from its q/k/v.
"""

from __future__ import annotations

from torch import nn

from minispeed.tensor_parallel.plan import Plan
from minispeed.tensor_parallel.styles import (
    Column,
    HeadInput,
    Heads,
    Row,
    ScatterSequence,
    SequenceShard,
    Vocab,
)

__all__ = ["gpt2_plan", "gpt_plan", "llama_plan"]


def gpt_plan(model: nn.Module, sequence_parallel: bool = False) -> Plan:
    """The plan for minispeed's GPT (examples/gpt.py); `sequence_parallel` adds Megatron-SP
    (layer norms on sequence shards, position embeddings scattered, all-gather / reduce-scatter
    around each block's column / row pair)."""
    c = model.cfg
    sp = sequence_parallel
    styles = {
        "wte": Vocab(sequence_parallel=sp),
        "blocks.*.attn": Heads(("n_head",)),
        "blocks.*.attn.qkv": Column(parts=3, sequence_parallel=sp),
        "blocks.*.attn.proj": Row(sequence_parallel=sp),
        "blocks.*.mlp.fc": Column(sequence_parallel=sp),
        "blocks.*.mlp.proj": Row(sequence_parallel=sp),
        "ln_f": HeadInput(sequence_parallel=sp),
    }
    if sp:
        styles |= {
            "wpe": ScatterSequence(),
            "blocks.*.ln1": SequenceShard(),
            "blocks.*.ln2": SequenceShard(),
        }
    return Plan(
        styles,
        {
            "heads (n_head)": c.n_head,
            "MLP width (4·n_embd)": 4 * c.n_embd,
            "vocabulary (vocab_size)": c.vocab_size,
        },
    )


def _refuse_sp(name: str, sequence_parallel: bool) -> None:
    if sequence_parallel:
        raise ValueError(
            f"{name}: sequence parallelism is not offered for Hugging Face models (their attention "
            "and mask code reshape by the input's sequence length); use sequence_parallel=False"
        )


def gpt2_plan(model: nn.Module, sequence_parallel: bool = False) -> Plan:
    """The plan for `transformers.GPT2LMHeadModel` (its `Conv1D` weights are `(in, out)`)."""
    _refuse_sp("gpt2_plan", sequence_parallel)
    c = model.config
    styles = {
        "transformer.wte": Vocab(),
        "transformer.h.*.attn": Heads(("num_heads", "split_size")),
        "transformer.h.*.attn.c_attn": Column(parts=3),
        "transformer.h.*.attn.c_proj": Row(),
        "transformer.h.*.mlp.c_fc": Column(),
        "transformer.h.*.mlp.c_proj": Row(),
        "lm_head": Column(),
    }
    return Plan(
        styles,
        {
            "heads (n_head)": c.n_head,
            "MLP width (n_inner)": c.n_inner or 4 * c.n_embd,
            "vocabulary (vocab_size)": c.vocab_size,
        },
    )


def llama_plan(model: nn.Module, sequence_parallel: bool = False) -> Plan:
    """The plan for `transformers.LlamaForCausalLM` (grouped-query attention: split by kv heads).

    The attention reshapes with `-1` heads and keeps the ratio `H/KV`, so no attribute needs
    dividing; any of `num_heads` / `num_key_value_heads` an older version keeps is divided."""
    _refuse_sp("llama_plan", sequence_parallel)
    c = model.config
    attn = model.model.layers[0].self_attn
    heads = tuple(
        a for a in ("num_heads", "num_key_value_heads") if isinstance(getattr(attn, a, None), int)
    )
    styles = {"model.embed_tokens": Vocab()}
    if heads:
        styles["model.layers.*.self_attn"] = Heads(heads)
    styles |= {
        "model.layers.*.self_attn.q_proj": Column(),
        "model.layers.*.self_attn.k_proj": Column(),
        "model.layers.*.self_attn.v_proj": Column(),
        "model.layers.*.self_attn.o_proj": Row(),
        "model.layers.*.mlp.gate_proj": Column(),
        "model.layers.*.mlp.up_proj": Column(),
        "model.layers.*.mlp.down_proj": Row(),
        "lm_head": Column(),
    }
    return Plan(
        styles,
        {
            "heads (num_attention_heads)": c.num_attention_heads,
            "kv heads (num_key_value_heads)": c.num_key_value_heads,
            "MLP width (intermediate_size)": c.intermediate_size,
            "vocabulary (vocab_size)": c.vocab_size,
        },
    )
