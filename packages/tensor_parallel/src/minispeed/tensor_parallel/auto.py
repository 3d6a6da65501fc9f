"""`auto_plan(model)`: a tensor-parallel plan read from a model's structure (DeepSpeed's AutoTP).

The ready plans (`plans.py`) name each module of one family; this one finds them, so a Hugging
Face causal LM of a family it has never seen by name (Qwen2, Mistral, OPT, GPT-NeoX, ...) gets the
Megatron split without a plan written for it. The plan is an ordinary `Plan` of the existing
styles, applied by `parallelize` with all of its checks. It is what `tp_model_init` (the Trainer's
`tensor_parallel.autotp_size`) and `init_inference(tensor_parallel=...)` without fused kernels
apply.

The rules, in each decoder layer (the `nn.ModuleList` of identical blocks that hold linears):

| linear (leaf name) | style | why |
|---|---|---|
| `o_proj`, `out_proj`, `down_proj`, `fc2`, `fc_out`, `c_proj`, `dense_4h_to_h`, `w2`, `wo`; `dense` inside an attention module | `Row()` | writes into the residual stream: partial sums, one all-reduce |
| `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`, `fc1`, `fc_in`, `c_fc`, `dense_h_to_4h`, `w1`, `w3`, `query`, `key`, `value` | `Column()` | reads the residual stream: output features split, no communication |
| `gate_up_proj` | `Column(parts=2)` | gate and up stacked: each rank keeps its slice of both |
| GPT-NeoX's and Bloom's `query_key_value`; Falcon's without `new_decoder_architecture` nor `multi_query` | `Column()` | rows ordered head by head (`(H, 3, d)`): a contiguous cut keeps whole heads with their q, k, v |
| Falcon's `query_key_value` with `new_decoder_architecture` | `Column()` | rows grouped per kv head (`(KV, H/KV + 2, d)`: its q heads, then its k and v): a contiguous cut keeps whole groups |
| Phi-3's `qkv_proj` | `Column(parts=(H, KV, KV))` | rows `[q: H·d; k: KV·d; v: KV·d]`, unequal under GQA: each part cut by heads (its forward reads q's width from `config.num_attention_heads`: divided on a copy of the config of that attention alone) |
| GPT-2's `c_attn` (`Conv1D`) | `Column(parts=3)` | q, k, v stacked |
| other fused q/k/v (`Wqkv`, `W_pack`, Falcon's multi-query `[q: H·d; k: d; v: d]` or with ALiBi, Bloom's `slow_but_exact`) | refused by path | one k/v head shared by all q heads cannot be split; Falcon folds ALiBi into one mask of all heads outside the layer; the others' layouts are not known here |
| a q/k norm inside the attention whose weight spans one head (`head_dim`: Qwen3's `q_norm` / `k_norm`, Phi's `q_layernorm`) | `HeadNorm()` | applied head by head, exact on split heads; its replicated weight's partial gradient is all-reduced |
| any other linear, or any other module with parameters beside the split linears inside their attention / MLP module (OLMo2's `q_norm` over all heads) | refused by path | the plan cannot tell whole from split activations there (norms held by the layer itself, as OPT's beside its `fc1` / `fc2`, are taken to read the residual stream) |

q/k/v are cut by whole heads: q keeps heads `[r·H/n, (r+1)·H/n)`, k and v kv heads
`[r·KV/n, (r+1)·KV/n)`, so grouped-query attention stays local (head h reads kv head `h // (H/KV)`
and both ranges are cut at the same place); the attention module's head counts it reshapes by
(`num_heads`, `num_key_value_heads`, ... where it keeps them) are divided (`Heads`). Bloom's
ALiBi biases, built by the model from the slopes of all H heads (`(B·H, 1, T)`, each head's
slope depends on its index and on H), are cut to the rank's heads on their way into the
attention (`Heads.per_head_kwargs`): dividing the count instead would give every rank the
slopes of an `H/n`-head model (for a power-of-two H, `2^(-8i·n/H)` for its i-th head, not
`2^(-8(i + r·H/n)/H)`). The size must
divide H, KV and every split width: checked before anything changes, the error naming each count
and the sizes that fit.

The output head (`lm_head`, GPT-NeoX's `embed_out`) gives **whole logits**, so the model's own
`labels=` loss and `generate` run unchanged: `Column(gather_output=True)` (each rank computes its
`V/n` logits, one all-gather joins them; its input gradient is all-reduced in backward). A head
tied to the token embedding stays whole on every rank with it (splitting one would split both).

Replicated (whole on every rank): the embeddings (token and position), every norm, the biases of
the row-parallel linears (added once, after the all-reduce), a tied head, any module outside
the decoder layers, and a layer's modules without linears reading the residual stream (Mixtral's
router and fused 3-D experts: the MoE block runs whole on every rank). Their inputs and output
gradients are whole, so their gradients are equal on every rank and nothing sums them; only a
`HeadNorm`'s weight, whole too but seeing `H/n` heads, has its gradient all-reduced.

Costs per rank, with L layers, width C, MLP width F, vocabulary V, H heads / KV kv heads of size
d, e bytes per element, M tokens per step, n ranks (Megatron's, `costs.py` per layer):

- **bytes kept**: `e·(Ψ_layers/n + Ψ_replicated)` (`kept_numel`), where a LLaMA-shaped layer splits
  `C·(H + 2·KV)·d + H·d·C + 3·C·F` weights and keeps its norms (`2·C`) whole; the untied head
  `e·V·C/n`, the embedding `e·V·C` whole (`e·V·C·(n−1)/n` more than a vocabulary split would keep,
  and no collective);
- **bytes all-reduced per layer**: two all-reduces in forward (attention out, MLP out), and in
  backward one per column linear (its input gradient: LLaMA's q, k, v, gate, up make 5; a fused
  `query_key_value` and one up projection make 2, as Megatron's), each of `e·M·C`; a ring puts
  `2(n−1)/n · e·M·C` on the wire per rank for each (`costs.column_collectives`,
  `costs.row_collectives`; DeepSpeed's AutoTP `LinearLayer` all-reduces each one's input gradient
  too);
- **the head**: one all-gather of the logits, `e·M·V` (`(n−1)/n` of it on the wire per rank),
  forward; one all-reduce of `e·M·C` backward. `vocab_parallel_cross_entropy` on split logits
  (the ready plans) avoids the gather but needs a loss that knows the split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minispeed.tensor_parallel.plan import Plan, _match
from minispeed.tensor_parallel.styles import Column, HeadNorm, Heads, Row, Style

__all__ = ["auto_plan", "decoder_layers", "kept_numel"]

ROW_NAMES = frozenset(
    {"o_proj", "out_proj", "down_proj", "fc2", "fc_out", "c_proj", "dense_4h_to_h", "w2", "wo"}
)
COLUMN_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "fc_in", "c_fc",
     "dense_h_to_4h", "w1", "w3", "query", "key", "value"}
)  # fmt: skip
QKV_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "query", "key", "value"})


def _phi3_qkv(attention: nn.Module) -> Style | str:
    """Phi-3's rows `[q: H·d; k: KV·d; v: KV·d]`: three parts in proportions `(H, KV, KV)`."""
    kv = attention.num_key_value_heads
    return Column(parts=(attention.config.num_attention_heads, kv, kv))


def _falcon_qkv(attention: nn.Module) -> Style | str:
    """Falcon's rows: grouped per kv head, `(KV, H/KV + 2, d)` (`new_decoder_architecture`), or
    per head, `(H, 3, d)` (neither new nor multi-query): a contiguous cut keeps whole groups
    (heads). Multi-query's `[q: H·d; k: d; v: d]` has one kv head to share, not to split; ALiBi
    is folded into a mask of all H heads by the model, outside the layer."""
    if getattr(attention.config, "alibi", False):
        return "ALiBi (config.alibi=True) is added to one attention mask of all heads"
    if not attention.new_decoder_architecture and attention.multi_query:
        return (
            "multi-query attention (config.multi_query=True) has one k/v head for all query "
            "heads, which cannot be split"
        )
    return Column()


def _bloom_qkv(attention: nn.Module) -> Style | str:
    """Bloom's rows ordered head by head, `(H, 3, d)` (GPT-NeoX's): a contiguous cut keeps whole
    heads; its ALiBi biases, built by the model for all H heads, are cut to this rank's heads
    (`Heads.per_head_kwargs`)."""
    if attention.pretraining_tp > 1 and attention.slow_but_exact:
        return (
            "config.slow_but_exact with pretraining_tp > 1 applies the output projection in "
            "slices of its whole weight"
        )
    return Column()


# Fused layers whose layout is known per attention class: (class name, leaf) -> the style (or
# the reason it cannot be split, a string), and the attention attributes beside the head counts
# that the split divides.
FUSED: dict[tuple[str, str], Callable[[nn.Module], Style | str]] = {
    ("GPTNeoXAttention", "query_key_value"): lambda _: Column(),
    ("GPT2Attention", "c_attn"): lambda _: Column(parts=3),
    ("Phi3Attention", "qkv_proj"): _phi3_qkv,
    ("FalconAttention", "query_key_value"): _falcon_qkv,
    ("FalconFlashAttention2", "query_key_value"): _falcon_qkv,
    ("BloomAttention", "query_key_value"): _bloom_qkv,
}
FUSED_EXTRA_ATTRS = {
    "GPT2Attention": ("split_size",),
    "Phi3Attention": ("config.num_attention_heads",),  # its forward reads q's width there
}
PER_HEAD_KWARGS = {"BloomAttention": ("alibi",)}  # built by the model for all heads
PACKED: dict[str, Style] = {"gate_up_proj": Column(parts=2)}
HEAD_ATTRS = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads",
              "n_head", "n_heads")  # fmt: skip
HEAD_NAMES = ("lm_head", "embed_out")
HEAD_NORM_NAMES = frozenset({"q_norm", "k_norm", "q_layernorm", "k_layernorm"})
_FIX = (
    "give a minispeed.tensor_parallel.Plan naming each module's style (training: "
    "initialize(..., tensor_parallel_plan=...)), or run without tensor parallelism"
)


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and hasattr(m, "nf"))


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The path and the `nn.ModuleList` of the model's decoder layers: the one list of identical
    blocks holding linears (an encoder-decoder's two lists, or none, are a `ValueError`)."""
    found = [
        (path, m)
        for path, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) > 0
        and len({type(b) for b in m}) == 1
        and any(_is_linear(s) for s in m[0].modules())
    ]  # fmt: skip
    # a list nested inside a layer (experts) belongs to that layer
    outer = [(p, m) for p, m in found if not any(p.startswith(q + ".") for q, _ in found)]
    if len(outer) != 1:
        what = [p for p, _ in outer] or "none"
        raise ValueError(
            f"automatic tensor-parallel plan for {type(model).__name__}: expected one list of "
            f"decoder layers (an nn.ModuleList of identical blocks with linears), found {what}; "
            + _FIX
        )
    return outer[0]


def _classify(layer: nn.Module, rel: str, where: str) -> Style:
    """The style of one linear of a decoder layer, by its leaf name (module docstring)."""
    parent_path, _, leaf = rel.rpartition(".")
    parent = layer.get_submodule(parent_path) if parent_path else layer
    layout = FUSED.get((type(parent).__name__, leaf))
    if layout is not None:
        fused = layout(parent)
        if isinstance(fused, str):
            raise ValueError(
                f"automatic tensor-parallel plan: {where} ({type(parent).__name__}.{leaf}) "
                f"cannot be split by heads: {fused}; {_FIX}"
            )
        return fused
    if leaf in PACKED:
        return PACKED[leaf]
    if leaf in ROW_NAMES or (leaf == "dense" and "att" in parent_path.rsplit(".", 1)[-1].lower()):
        return Row()
    if leaf in COLUMN_NAMES:
        return Column()
    if "qkv" in leaf.lower() or leaf in ("query_key_value", "W_pack"):
        raise ValueError(
            f"automatic tensor-parallel plan: {where} ({type(parent).__name__}.{leaf}) fuses "
            "q, k and v in a layout the plan does not know for this family (unequal widths under "
            f"grouped-query attention, or grouped kv rows); {_FIX}"
        )
    raise ValueError(
        f"automatic tensor-parallel plan: {where} is a linear the plan does not recognise (neither "
        f"a q/k/v/gate/up projection, split by columns, nor an output/down projection, split by "
        f"rows: {sorted(ROW_NAMES)}); {_FIX}"
    )


def _is_head_norm(attention: nn.Module, name: str, norm: nn.Module) -> bool:
    """A norm named as a q/k norm whose weight spans one head (`head_dim` features): applied to
    each head alone, so a split by heads leaves it exact (OLMo2's spans all heads: refused)."""
    weight = getattr(norm, "weight", None)
    head_dim = getattr(attention, "head_dim", None)
    return (
        name.rpartition(".")[2] in HEAD_NORM_NAMES
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and weight.numel() == head_dim
    )


def _layer_styles(layer: nn.Module, prefix: str) -> dict[str, Style]:
    """`{relative path: style}` for one layer: its linears, and `Heads` on each attention."""
    styles: dict[str, Style] = {}
    attentions: set[str] = set()  # the modules holding q/k/v (or a fused qkv)
    for rel, m in layer.named_modules():
        if rel and _is_linear(m):
            styles[rel] = _classify(layer, rel, f"{prefix}.{rel}")
            parent, _, leaf = rel.rpartition(".")
            kind = type(layer.get_submodule(parent)).__name__
            if leaf in QKV_NAMES or (kind, leaf) in FUSED:
                attentions.add(parent)
    # Modules with parameters beside the split linears inside their attention / MLP module
    # see split activations: a norm over one head's features (Qwen3's q_norm) is a HeadNorm,
    # anything else is refused. Linears held by the layer itself (OPT's fc1 / fc2) sit beside
    # its norms, which read the residual stream.
    for parent in {rel.rpartition(".")[0] for rel in styles} - {""}:
        for name, child in layer.get_submodule(parent).named_modules(prefix=parent):
            if name == parent or name in styles or any(name.startswith(s + ".") for s in styles):
                continue
            if next(child.parameters(recurse=False), None) is None:
                continue
            if parent in attentions and _is_head_norm(layer.get_submodule(parent), name, child):
                styles[name] = HeadNorm()
            else:
                raise ValueError(
                    f"automatic tensor-parallel plan: {prefix}.{name} ({type(child).__name__}) "
                    "has parameters inside a module whose linears are split and is not a q/k "
                    "norm over one head: the plan cannot tell whether it sees whole or split "
                    f"activations (a norm over all heads cannot be split at all); {_FIX}"
                )
    for parent in sorted(attentions):  # the head counts the attention reshapes by, divided
        module = layer.get_submodule(parent)
        attrs = [a for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)]
        attrs += FUSED_EXTRA_ATTRS.get(type(module).__name__, ())
        if attrs:
            styles[parent] = Heads(tuple(attrs), PER_HEAD_KWARGS.get(type(module).__name__, ()))
    return styles


def _counts(model: nn.Module) -> dict[str, int]:
    """The head counts of the model's config the size must divide (named as the config does)."""
    c = getattr(model, "config", None)
    out: dict[str, int] = {}
    for label, names in (("heads", ("num_attention_heads", "n_head", "num_heads")),
                         ("kv heads", ("num_key_value_heads", "num_kv_heads"))):  # fmt: skip
        for name in names:
            value = getattr(c, name, None)
            if isinstance(value, int) and value > 0:
                out[f"{label} ({name})"] = value
                break
    return out


def auto_plan(model: nn.Module) -> Plan:
    """The plan read from `model`'s structure (module docstring): decoder layers split the
    Megatron way by leaf names, q/k/v by whole heads, the output head gathering whole logits,
    the rest replicated. A module it does not recognise is a `ValueError` naming its path."""
    list_path, layers = decoder_layers(model)
    template = _layer_styles(layers[0], f"{list_path}.0")
    for i, layer in enumerate(layers):
        here = _layer_styles(layer, f"{list_path}.{i}")
        if here != template:
            raise ValueError(
                f"automatic tensor-parallel plan: {list_path}.{i} is built unlike "
                f"{list_path}.0 ({sorted(set(here) ^ set(template))} differ); {_FIX}"
            )
    styles: dict[str, Style] = {f"{list_path}.*.{rel}": s for rel, s in template.items()}
    divides = _counts(model)
    head_name = next(
        (n for n in HEAD_NAMES if isinstance(getattr(model, n, None), nn.Linear)), None
    )
    if head_name is not None:
        head = getattr(model, head_name)
        tied = any(isinstance(m, nn.Embedding) and m.weight is head.weight for m in model.modules())
        if not tied:  # a tied head stays whole with its embedding (module docstring)
            styles[head_name] = Column(gather_output=True)
            divides[f"vocabulary ({head_name} output features)"] = head.out_features
    return Plan(styles, divides)


def kept_numel(model: nn.Module, plan: Plan, n: int) -> int:
    """Parameter elements one rank keeps once `plan` splits the (unsplit) `model` over `n` ranks:
    a column-parallel linear's weight and bias `1/n`, a row-parallel linear's weight `1/n` and
    its bias whole, everything else whole (the module docstring's `Ψ_layers/n + Ψ_replicated`;
    a tied weight counted once). Local; works on a `meta`-device model, so a size can be costed
    without building it."""
    split: dict[int, int] = {}  # id(parameter) -> the elements one rank keeps
    for path, (_, style) in _match(model, plan).items():  # as parallelize matches them
        m = model.get_submodule(path)
        if isinstance(style, Column | Row):
            split[id(m.weight)] = m.weight.numel() // n
            if m.bias is not None and isinstance(style, Column):
                split[id(m.bias)] = m.bias.numel() // n
    return sum(split.get(id(p), p.numel()) for p in model.parameters())
