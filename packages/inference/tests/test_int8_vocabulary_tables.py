"""int8 vocabulary tables (Note [int8 vocabulary] in fused_gpt.py): with `dtype=torch.int8` the
token embedding and the output head are held as int8 rows, once when tied, and no fp32 copy of
them is kept; lookups and logits stay within the rounding bound of fp32, and greedy tokens equal
the int8 path's pure-PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from minispeed.inference import SamplingConfig, generate, init_inference
from minispeed.inference.kernels import reference
from minispeed.inference.quantize import Int8Embedding, held_bytes, quantize_per_channel

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

V, C = 1009, 24  # a vocabulary much larger than the blocks, as in GPT-2 and LLaMA


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=32, n_embd=C, n_layer=2, n_head=3,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval()


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=C, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40,
        bos_token_id=0, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def test_int8_table_lookup_and_logits_are_within_the_rounding_bound():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(V, C, generator=g), torch.randn(5, C, generator=g)
    table = Int8Embedding(w)
    q, s = quantize_per_channel(w)
    idx = torch.tensor([[3, 1008], [0, 3]])
    # the lookup dequantizes exactly the gathered rows: q[v] · s_v, within s_v / 2 of fp32
    assert torch.equal(table(idx), q[idx].float() * s[idx, None])
    assert ((table(idx) - w[idx]).abs() <= s[idx, None] / 2 + 1e-6).all()
    # each logit within (s_v / 2) · Σ|x| of the fp32 head's, and equal to the reference op's
    logits = table.logits(x)
    bound = s[None, :] / 2 * x.abs().sum(-1, keepdim=True)
    assert ((logits - x @ w.T).abs() <= bound * (1 + 1e-5) + 1e-5).all()
    torch.testing.assert_close(logits, reference.int8_linear(x, q, s), rtol=1e-5, atol=1e-5)


def test_gpt2_int8_holds_the_tied_table_once_as_int8_rows():
    model = _gpt2()
    engine, _ = init_inference(model, dtype=torch.int8)
    assert engine.head_q is engine.wte and engine.wte.weight_q.dtype == torch.int8
    # Held: the int8 blocks, positions, final norm and the table at V·C + 4·V bytes, no fp32
    # (V, C) copy: 3·V·C − 4·V bytes fewer than the fp32 table it replaces (~3/4 of the head).
    table = V * C + 4 * V
    rest = held_bytes(engine.blocks) + held_bytes(engine.wpe) + held_bytes(engine.ln_f)
    assert held_bytes(engine) == rest + table
    fp32_table = model.transformer.wte.weight
    assert all(t.untyped_storage().data_ptr() != fp32_table.untyped_storage().data_ptr()
               for t in (*engine.parameters(), *engine.buffers()))  # fmt: skip
    idx = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = model(idx).logits, engine(idx)
    # int8 blocks and head together: within 5 % of the largest fp32 logit on this model
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_llama_int8_holds_embedding_and_head_as_int8_rows():
    model = _llama()
    engine, _ = init_inference(model, dtype=torch.int8)
    assert engine.head_q is not engine.wte and engine.head_weight is None
    table = V * C + 4 * V  # the embedding and the untied head, one each
    assert held_bytes(engine) == held_bytes(engine.blocks) + held_bytes(engine.ln_f) + 2 * table
    idx = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = model(idx).logits, engine(idx)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_int8_greedy_tokens_equal_the_reference_and_recomputation(build, monkeypatch):
    engine, _ = init_inference(build(), dtype=torch.int8)
    prompts, cfg = [[1, 2, 3, 4, 5], [9]], SamplingConfig(max_new_tokens=8)
    got = generate(engine, prompts, cfg, kv_block_size=4)
    # the decode head reads one row at a time, the full forward all positions: same logits bits
    assert got == generate(engine, prompts, cfg, use_cache=False)
    monkeypatch.setenv("MINISPEED_DISABLE_OPS", "inference_kernels")
    assert got == generate(engine, prompts, cfg, kv_block_size=4)
