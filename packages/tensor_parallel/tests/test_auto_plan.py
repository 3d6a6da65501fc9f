"""`auto_plan`: the plan read from a Hugging Face model's structure (AutoTP). On 2 gloo ranks the
model's own `labels=` loss, its whole logits and every parameter's gradient (slices gathered back)
equal the unsplit model's, for LLaMA (GQA), Qwen2 (q/k/v biases, tied head), Qwen3 (q/k norms
over each head: their gradients summed over the ranks), OPT (learned
positions, linears on the layer itself, `num_heads` divided), GPT-NeoX (fused per-head
`query_key_value`), GPT-2 (`Conv1D`, fused `c_attn`), Phi (`self_attn.dense`) and Mixtral (its
experts, fused 3-D weights without linears, stay whole on every rank), a LLaMA whose MLP
stacks gate and up in one `gate_up_proj`, Phi-3 (fused `qkv_proj` of unequal q/k/v widths under
GQA, `gate_up_proj`), Falcon's new decoder (`query_key_value` grouped per kv head) and Bloom
(per-head `query_key_value`, ALiBi slopes of all heads cut per rank); families it cannot read
(Falcon's multi-query or ALiBi layers, Bloom's `slow_but_exact`) are refused naming the module."""

from __future__ import annotations

import pytest
import torch

import minispeed.comm as comm
import minispeed.tensor_parallel as tp
from minispeed.core.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

VOCAB = 48
FAMILIES = ("llama", "qwen2", "qwen3", "opt", "gpt_neox", "gpt2", "phi", "mixtral", "gate_up",
            "phi3", "falcon", "bloom")  # fmt: skip


class _PackedMLP(torch.nn.Module):
    """LLaMA's MLP with gate and up stacked in one `gate_up_proj` (Phi-3's and GLM's layout)."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(32, 88, bias=False)
        with torch.no_grad():
            self.gate_up_proj.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


def _model(name: str):
    torch.manual_seed(0)
    t = transformers
    gqa = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
               use_cache=False, pad_token_id=None)  # fmt: skip
    if name in ("llama", "gate_up"):
        model = t.LlamaForCausalLM(t.LlamaConfig(**gqa, tie_word_embeddings=False))
        if name == "gate_up":  # cut as Column(parts=2): each rank keeps its slice of both
            for layer in model.model.layers:
                layer.mlp = _PackedMLP(layer.mlp)
        return model
    if name == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**gqa, tie_word_embeddings=True))
    if name == "qwen3":  # q_norm / k_norm over each head: HeadNorm, its gradient summed
        return t.Qwen3ForCausalLM(t.Qwen3Config(**gqa, head_dim=8, tie_word_embeddings=False))
    if name == "opt":
        return t.OPTForCausalLM(t.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
            max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0, use_cache=False,
        ))  # fmt: skip
    if name == "phi":  # the attention's output projection is `self_attn.dense`
        return t.PhiForCausalLM(t.PhiConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=16, resid_pdrop=0.0, embd_pdrop=0.0,
            use_cache=False,
        ))  # fmt: skip
    if name == "phi3":  # fused qkv_proj [q: H·d; k: KV·d; v: KV·d] (Column(parts=(4, 2, 2)))
        return t.Phi3ForCausalLM(t.Phi3Config(**gqa, tie_word_embeddings=False))
    if name == "falcon":  # fused query_key_value grouped per kv head, (KV, H/KV + 2, d)
        return t.FalconForCausalLM(t.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_kv_heads=2, new_decoder_architecture=True, bias=True, use_cache=False,
        ))  # fmt: skip
    if name == "bloom":  # per-head query_key_value; ALiBi slopes of all 8 heads, cut per rank
        return t.BloomForCausalLM(t.BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=8, hidden_dropout=0.0,
            use_cache=False,
        ))  # fmt: skip
    if name == "mixtral":  # fused 3-D experts and their router: no linears, kept whole
        return t.MixtralForCausalLM(t.MixtralConfig(**gqa, num_local_experts=2))
    if name == "gpt_neox":
        return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=32, use_cache=False,
            attention_bias=True, tie_word_embeddings=False,
        ))  # fmt: skip
    return t.GPT2LMHeadModel(t.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
    ))  # fmt: skip


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _body(rank: int, world_size: int) -> dict:
    out = {}
    for name in FAMILIES:
        model = _model(name)
        plan = tp.auto_plan(model)
        formula = tp.kept_numel(model, plan, world_size)
        tp.parallelize(model, plan, None)
        idx = _batch()
        with comm.CommsLogger() as log:
            result = model(input_ids=idx, labels=idx)  # the model's own loss, on whole logits
            result.loss.backward()
        out[name] = {
            "records": [(r.op, r.msg_bytes, r.wire_bytes, r.impl) for r in log.records],
            "loss": result.loss.detach(),
            "logits": result.logits.detach(),
            "grads": tp.unshard_module(model, tp.TensorGroup.of(None), grads=True),
            "params": (formula, sum(p.numel() for p in model.parameters())),
            "config": model.config.to_dict(),  # whole: what save_pretrained writes
        }
    return out


def _llama_step_collectives(n: int) -> list[tp.Collective]:
    """One forward and backward of the split LLaMA, written out from the layers' formulas: per
    layer 5 column linears (q, k, v, gate, up: each all-reduces its input gradient) and 2 row
    linears (o, down: one all-reduce each in forward); the head all-gathers the logits."""
    M, C, d, F = 2 * 12, 32, 8, 44
    layer = (
        tp.column_collectives(M, C, 4 * d, n) + tp.column_collectives(M, C, 2 * d, n) * 2
        + tp.row_collectives(M, 4 * d, C, n)
        + tp.column_collectives(M, C, F, n) * 2 + tp.row_collectives(M, F, C, n)
    )  # fmt: skip
    return layer * 2 + tp.column_collectives(M, C, VOCAB, n, gather_output=True)


def test_auto_plan_over_2_ranks_equals_unsplit(rel_close, logged_bytes):
    results = run_distributed(_body, world_size=2, timeout_s=240)
    for name in FAMILIES:
        model = _model(name)
        idx = _batch()
        want = model(input_ids=idx, labels=idx)
        want.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        for got in (r[name] for r in results):
            rel_close(got["loss"], want.loss.detach())
            rel_close(got["logits"], want.logits.detach())  # whole logits on every rank
            assert set(got["grads"]) == set(grads), name
            for n, g in grads.items():
                if g.abs().max() < 1e-8:  # zero by symmetry (a key bias under softmax): rounding
                    assert got["grads"][n].abs().max() < 1e-8, (name, n)
                else:
                    rel_close(got["grads"][n], g)
            assert got["config"] == model.config.to_dict(), name  # Phi-3's heads divided on a copy
            formula, local = got["params"]  # bytes kept: the formula's, less than the whole
            assert local == formula < sum(p.numel() for p in model.parameters()), name
    for got in results:
        logged_bytes(got["llama"]["records"], _llama_step_collectives(2), 2)


def test_auto_plan_styles_for_llama():
    """The split written out: q/k/v, gate, up by columns; o, down by rows; the head gathers."""
    plan = tp.auto_plan(_model("llama"))
    col, row = tp.Column(), tp.Row()
    assert plan.styles == {
        "model.layers.*.self_attn.q_proj": col, "model.layers.*.self_attn.k_proj": col,
        "model.layers.*.self_attn.v_proj": col, "model.layers.*.self_attn.o_proj": row,
        "model.layers.*.mlp.gate_proj": col, "model.layers.*.mlp.up_proj": col,
        "model.layers.*.mlp.down_proj": row, "lm_head": tp.Column(gather_output=True),
    }  # fmt: skip
    # the sizes that must divide, named as the config names them
    with pytest.raises(
        ValueError, match=r"num_key_value_heads\) \(2\).*pick a size among \[1, 2\]"
    ):
        tp.check_divides(4, plan.divides)


def test_modules_the_plan_cannot_read_are_refused_by_path():
    t = transformers
    falcon = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    for options, why in (({}, "multi-query"), ({"multi_query": False, "alibi": True}, "ALiBi")):
        model = t.FalconForCausalLM(t.FalconConfig(**falcon, **options))
        with pytest.raises(
            ValueError, match=rf"transformer\.h\.0\.self_attention\.query_key_value .*{why}"
        ):
            tp.auto_plan(model)
    olmo2 = t.Olmo2ForCausalLM(t.Olmo2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    ))  # fmt: skip
    bloom = t.BloomForCausalLM(t.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4, pretraining_tp=2, slow_but_exact=True,
    ))  # fmt: skip
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.self_attention\.query_key_value .*slow_but_exact"):  # fmt: skip
        tp.auto_plan(bloom)
    bloom = _model(
        "bloom"
    )  # its ALiBi biases passed by position cannot be cut: an error, not wrong
    tp.parallelize(bloom, tp.auto_plan(bloom), tp.TensorGroup(0, 2))  # slopes (no collective yet)
    x, alibi = torch.zeros(1, 3, 32), torch.zeros(8, 1, 3)
    with pytest.raises(RuntimeError, match=r"BloomAttention was called without .*'alibi'"):
        bloom.transformer.h[0].self_attention(x, x, alibi, None)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_norm \(Olmo2RMSNorm\)"):
        tp.auto_plan(olmo2)  # its q_norm spans all heads at once
    llama = _model("llama")
    llama.model.layers[0].mlp.extra = torch.nn.Linear(32, 32)
    for layer in llama.model.layers[1:]:
        layer.mlp.extra = torch.nn.Linear(32, 32)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra is a linear the plan"):
        tp.auto_plan(llama)
    t5 = t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8,
    ))  # fmt: skip
    with pytest.raises(ValueError, match=r"found \['encoder.block', 'decoder.block'\]"):
        tp.auto_plan(t5)
