"""`init_inference`: recognise a model's blocks by policy and swap them for fused inference blocks.

A policy knows one model family: whether a model is of it, whether a block is one it can fuse,
and how to build the inference model: minispeed's own GPT (examples/gpt.py), Hugging Face's
`GPT2LMHeadModel` and `LlamaForCausalLM`.
Blocks a policy cannot fuse are kept and listed in the report with the reason; the model still
runs (full forward: Hugging Face layers get the causal mask and rotary tables their model would
give them, see `kept_blocks.py`), but the KV-cache paths need every block fused.

Module tree, before and after (GPT with L blocks):

```text
GPT                                  InferenceGPT
├─ wte, wpe                          ├─ wte, wpe                 (same modules)
├─ blocks: L × Block                 ├─ blocks: L × FusedGPTBlock
│   ├─ ln1, attn(qkv, proj)          │   ├─ ln1, qkv, attn_proj  (same weights; int8 copies)
│   └─ ln2, mlp(fc, proj)            │   └─ ln2, fc (no bias), fc_bias, mlp_proj
└─ ln_f                              └─ ln_f
                                     int8: wte an Int8Embedding (int8 rows), also the tied head
```
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from minispeed.inference.fused_gpt import FusedGPTBlock, InferenceGPT
from minispeed.inference.kept_blocks import KeptHFBlock
from minispeed.inference.tensor_parallel import TPConfig, TPContext, check_divides, resolve

__all__ = ["GPTPolicy", "InjectionReport", "init_inference", "is_recognised"]


@dataclass(frozen=True)
class InjectionReport:
    """What `init_inference` did: the policy used, blocks replaced and blocks left as they were."""

    policy: str
    replaced: tuple[str, ...]
    """Qualified names of the blocks now fused (e.g. `blocks.0`)."""
    kept: tuple[str, ...]
    """Qualified names and types of the blocks left unfused, each with the reason."""
    dtype: torch.dtype
    tp_size: int = 1
    """Ranks each fused block is split over (kept blocks run whole on every rank)."""

    def __str__(self) -> str:
        kept = ", ".join(self.kept) if self.kept else "none"
        tp = f", tensor-parallel over {self.tp_size} ranks" if self.tp_size > 1 else ""
        return (
            f"policy {self.policy} ({self.dtype}{tp}): replaced {len(self.replaced)} blocks; "
            f"kept: {kept}"
        )


class GPTPolicy:
    """minispeed's GPT: `wte`, `wpe`, `blocks`, `ln_f`, `cfg`; blocks with ln1/attn/ln2/mlp."""

    name = "minispeed-gpt"

    @staticmethod
    def matches_model(model: nn.Module) -> bool:
        return all(
            hasattr(model, a) for a in ("wte", "wpe", "blocks", "ln_f", "cfg")
        ) and isinstance(model.blocks, nn.ModuleList)

    @staticmethod
    def matches_block(block: nn.Module) -> bool:
        """The exact `Block` layout of examples/gpt.py (a subclass may compute something else)."""
        if type(block).__name__ != "Block":
            return False
        attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
        linears = [getattr(attn, "qkv", None), getattr(attn, "proj", None),
                   getattr(mlp, "fc", None), getattr(mlp, "proj", None)]  # fmt: skip
        norms = [getattr(block, "ln1", None), getattr(block, "ln2", None)]
        return (
            all(isinstance(m, nn.Linear) and m.bias is not None for m in linears)
            and all(isinstance(m, nn.LayerNorm) and m.elementwise_affine for m in norms)
            and isinstance(getattr(attn, "n_head", None), int)
        )

    @classmethod
    def why_not_fused(cls, block: nn.Module, model: nn.Module) -> str | None:
        if cls.matches_block(block):
            return None
        return "not the Block layout of examples/gpt.py (ln1, attn.qkv/proj, ln2, mlp.fc/proj)"

    @staticmethod
    def keep(block: nn.Module, model: nn.Module, why: str) -> nn.Module:
        return block  # self-contained: causal attention, positions added before the blocks

    @staticmethod
    def blocks(model: nn.Module) -> nn.ModuleList:
        return model.blocks

    @staticmethod
    def tp_sizes(model: nn.Module) -> dict[str, int]:
        """What tensor parallelism cuts: the heads and the MLP's hidden width."""
        return {"heads (n_head)": model.cfg.n_head, "MLP width (4·n_embd)": 4 * model.cfg.n_embd}

    @staticmethod
    def fuse(block: nn.Module, int8: bool, model: nn.Module, tp: TPContext | None) -> FusedGPTBlock:
        return FusedGPTBlock(block, int8=int8, tp=tp)

    @staticmethod
    def build(
        model: nn.Module, blocks: list[nn.Module], tp: TPContext | None, int8: bool
    ) -> InferenceGPT:
        c = model.cfg
        n = 1 if tp is None else tp.size
        return InferenceGPT(model.wte, model.wpe, blocks, model.ln_f, c.n_head // n,
                            head_dim=c.n_embd // c.n_head, tp=tp, int8=int8)  # fmt: skip


def _conv1d_as_linear(conv: nn.Module) -> nn.Linear:
    """HF's `Conv1D` (`y = x W + b`, W `(in, out)`) as an `nn.Linear` sharing W's storage (Wᵀ view)."""
    n_in, n_out = conv.weight.shape
    linear = nn.Linear(n_in, n_out, device="meta")
    linear.weight = nn.Parameter(conv.weight.detach().t(), requires_grad=False)
    linear.bias = nn.Parameter(conv.bias.detach(), requires_grad=False)
    return linear


class GPT2Policy:
    """Hugging Face `GPT2LMHeadModel` (transformers; small random configs in the tests).

    `GPT2Block` is the same pre-norm block as minispeed's; its `Conv1D` weights are shared as
    transposed views. Only the standard attention is fused (`scale_attn_weights=True`, no
    per-layer scaling, no reordered upcast); `gelu_new` (tanh GeLU) runs torch's GeLU after the
    fused norms, exact `gelu` the fused bias + GeLU kernel.
    """

    name = "hf-gpt2"

    @staticmethod
    def matches_model(model: nn.Module) -> bool:
        return type(model).__name__ == "GPT2LMHeadModel" and hasattr(model, "transformer")

    @staticmethod
    def why_not_fused(block: nn.Module, model: nn.Module) -> str | None:
        if type(block).__name__ != "GPT2Block":
            return "not a GPT2Block"
        attn = block.attn
        checks = [
            (getattr(block, "crossattention", None) is not None, "cross-attention"),
            (not getattr(attn, "scale_attn_weights", True), "scale_attn_weights=False"),
            (getattr(attn, "scale_attn_by_inverse_layer_idx", False),
             "scale_attn_by_inverse_layer_idx=True"),
            (getattr(attn, "reorder_and_upcast_attn", False), "reorder_and_upcast_attn=True"),
            (type(block.mlp.act).__name__ not in ("NewGELUActivation", "GELUActivation"),
             f"activation {type(block.mlp.act).__name__} (the fused MLP has gelu and gelu_new)"),
        ]  # fmt: skip
        return next((why for bad, why in checks if bad), None)

    @staticmethod
    def keep(block: nn.Module, model: nn.Module, why: str) -> nn.Module:
        return KeptHFBlock(block, why)

    @staticmethod
    def blocks(model: nn.Module) -> nn.ModuleList:
        return model.transformer.h

    @staticmethod
    def tp_sizes(model: nn.Module) -> dict[str, int]:
        c = model.config
        return {"heads (n_head)": c.n_head, "MLP width (n_inner)": c.n_inner or 4 * c.n_embd}

    @staticmethod
    def fuse(block: nn.Module, int8: bool, model: nn.Module, tp: TPContext | None) -> FusedGPTBlock:
        view = SimpleNamespace(
            ln1=block.ln_1,
            ln2=block.ln_2,
            attn=SimpleNamespace(n_head=block.attn.num_heads, qkv=_conv1d_as_linear(block.attn.c_attn),
                                 proj=_conv1d_as_linear(block.attn.c_proj)),
            mlp=SimpleNamespace(fc=_conv1d_as_linear(block.mlp.c_fc), proj=_conv1d_as_linear(block.mlp.c_proj)),
        )  # fmt: skip
        tanh = type(block.mlp.act).__name__ == "NewGELUActivation"
        return FusedGPTBlock(view, int8=int8, tanh_gelu=tanh, tp=tp)

    @staticmethod
    def build(
        model: nn.Module, blocks: list[nn.Module], tp: TPContext | None, int8: bool
    ) -> InferenceGPT:
        t, c = model.transformer, model.config
        tied = model.lm_head.weight is t.wte.weight
        head = None if tied else model.lm_head.weight
        n = 1 if tp is None else tp.size
        return InferenceGPT(t.wte, t.wpe, blocks, t.ln_f, c.n_head // n, head_weight=head,
                            head_dim=c.n_embd // c.n_head, tp=tp, int8=int8)  # fmt: skip


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


class LlamaPolicy:
    """Hugging Face `LlamaForCausalLM`: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

    Fused: layers without biases on the attention or MLP linears, with SiLU, and with a RoPE
    whose angles depend on the position alone (default, linear, llama3, yarn: the tables come
    from the model's own rotary module). Other layers are kept with the reason (see
    `minispeed.inference.fused_llama` for the fused layer).
    """

    name = "hf-llama"

    @staticmethod
    def matches_model(model: nn.Module) -> bool:
        return type(model).__name__ == "LlamaForCausalLM" and hasattr(model, "model")

    @staticmethod
    def why_not_fused(block: nn.Module, model: nn.Module) -> str | None:
        from minispeed.inference.fused_llama import STATIC_ROPE_TYPES

        if type(block).__name__ != "LlamaDecoderLayer":
            return "not a LlamaDecoderLayer"
        attn, mlp = block.self_attn, block.mlp
        if any(m.bias is not None for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)):
            return "attention linears have biases (attention_bias=True)"
        if any(m.bias is not None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            return "MLP linears have biases (mlp_bias=True)"
        if not (type(mlp.act_fn).__name__ == "SiLUActivation" or isinstance(mlp.act_fn, nn.SiLU)):
            return f"activation {type(mlp.act_fn).__name__} (the fused MLP has SiLU)"
        rope_type = _rope_type(model.config)
        if rope_type not in STATIC_ROPE_TYPES:
            return (
                f"rope_type {rope_type!r} rescales with the sequence length, one rotary table "
                f"cannot serve the KV cache (fused: {list(STATIC_ROPE_TYPES)})"
            )
        return None

    @staticmethod
    def keep(block: nn.Module, model: nn.Module, why: str) -> nn.Module:
        return KeptHFBlock(block, why, rotary=model.model.rotary_emb)

    @staticmethod
    def blocks(model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    @staticmethod
    def tp_sizes(model: nn.Module) -> dict[str, int]:
        c = model.config
        return {
            "heads (num_attention_heads)": c.num_attention_heads,
            "kv heads (num_key_value_heads)": c.num_key_value_heads,
            "MLP width (intermediate_size)": c.intermediate_size,
        }

    @staticmethod
    def fuse(block: nn.Module, int8: bool, model: nn.Module, tp: TPContext | None) -> nn.Module:
        from minispeed.inference.fused_llama import FusedLlamaBlock, rotary_tables_of

        c = model.config
        rotary = rotary_tables_of(
            model.model.rotary_emb, c.max_position_embeddings, block.self_attn.head_dim
        )
        return FusedLlamaBlock(block, c.num_attention_heads, c.num_key_value_heads, rotary,
                               int8=int8, tp=tp)  # fmt: skip

    @staticmethod
    def build(
        model: nn.Module, blocks: list[nn.Module], tp: TPContext | None, int8: bool
    ) -> InferenceGPT:
        m, c = model.model, model.config
        tied = model.lm_head.weight is m.embed_tokens.weight
        n = 1 if tp is None else tp.size
        return InferenceGPT(
            m.embed_tokens, None, blocks, m.norm, c.num_attention_heads // n,
            head_weight=None if tied else model.lm_head.weight,
            max_positions=c.max_position_embeddings, rms_final_norm=True,
            head_dim=blocks[0].head_dim if blocks and hasattr(blocks[0], "head_dim") else None,
            tp=tp, n_kv_head=c.num_key_value_heads // n, int8=int8,
        )  # fmt: skip


POLICIES = (GPTPolicy, GPT2Policy, LlamaPolicy)


def _policy_for(model: nn.Module) -> Any:
    return next((p for p in POLICIES if p.matches_model(model)), None)


def is_recognised(model: nn.Module) -> bool:
    """Whether an injection policy recognises `model` (`init_inference` can fuse it)."""
    return _policy_for(model) is not None


def init_inference(
    model: nn.Module,
    dtype: torch.dtype = torch.float32,
    replace_with_kernel_inject: bool = True,
    tensor_parallel: dict | int | TPConfig | None = None,
) -> tuple[InferenceGPT, InjectionReport]:
    """The inference form of `model` and a report of what changed. The model is put in eval mode.

    `dtype`: `torch.float32` (weights shared with `model`, no copy) or `torch.int8` (weight-only:
    each fused block's linears become `Int8Linear`, and the token embedding and output head
    `Int8Embedding`s, one copy when tied: ≈ 4× fewer weight bytes, see Note [int8 vocabulary] in
    fused_gpt.py; activations, norms, biases and learned positions stay fp32).
    `replace_with_kernel_inject=False` keeps every block as it is (eager, no KV cache).
    `tensor_parallel`: DeepSpeed's section (`{"tp_size": 2}`, optionally `"tp_group"`) or an int:
    each fused block is split over that many ranks (see `minispeed.inference.tensor_parallel`;
    collective: every rank of the group calls `init_inference` with the same model). A TP size
    that does not divide the heads (LLaMA: also the kv heads) or the MLP width is a `ValueError`
    on every rank, raised before any rank communicates.
    """
    if dtype not in (torch.float32, torch.int8):
        raise TypeError(
            f"init_inference supports dtype=torch.float32 or torch.int8 (weight-only), got {dtype}: "
            "bf16/fp16 kernels are not implemented"
        )
    policy = _policy_for(model)
    if policy is None:
        raise ValueError(
            f"no injection policy recognises {type(model).__name__}; known: "
            f"{[p.name for p in POLICIES]}: only these model families can be wrapped (HF GPT-2 and LLaMA "
            "need transformers' classes); run the model eagerly instead"
        )
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise TypeError("init_inference expects an fp32 model: call model.float() first")
    if tensor_parallel is None or isinstance(tensor_parallel, TPConfig):
        tp_cfg = tensor_parallel or TPConfig()
    elif isinstance(tensor_parallel, int) and not isinstance(tensor_parallel, bool):
        tp_cfg = TPConfig(tp_size=tensor_parallel)
    else:
        tp_cfg = TPConfig.from_section(tensor_parallel)
    if tp_cfg.tp_size > 1 and not replace_with_kernel_inject:
        raise ValueError(
            "tensor_parallel needs the fused blocks: pass replace_with_kernel_inject=True "
            "(or tensor_parallel=None)"
        )
    check_divides(tp_cfg.tp_size, policy.tp_sizes(model))
    tp = resolve(tp_cfg)  # collective when it builds the TP group
    model.eval()
    blocks, replaced, kept = [], [], []
    for i, block in enumerate(policy.blocks(model)):
        why = (
            policy.why_not_fused(block, model)
            if replace_with_kernel_inject
            else "replace_with_kernel_inject=False"
        )
        if why is None:
            blocks.append(policy.fuse(block, dtype == torch.int8, model, tp))
            replaced.append(f"blocks.{i}")
        else:
            blocks.append(policy.keep(block, model, why))
            kept.append(f"blocks.{i} ({type(block).__name__}: {why})")
    report = InjectionReport(policy.name, tuple(replaced), tuple(kept), dtype, tp_cfg.tp_size)
    return policy.build(model, blocks, tp, dtype == torch.int8).eval(), report
