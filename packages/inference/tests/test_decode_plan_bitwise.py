"""The decode step's blocks as raw op calls (decode_plan.py: GPT, GPT-2, LLaMA) give the block
loop's logits bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from minispeed.inference import decode_plan, init_inference, kernels

pytestmark = pytest.mark.timeout(300)


def _models(gpt_module):
    torch.manual_seed(0)
    cfg = gpt_module.GPTConfig(vocab_size=31, block_size=40, n_layer=2, n_head=2, n_embd=32)
    yield "gpt", gpt_module.GPT(cfg).eval()  # nn.Linear weights: the op's (N, K) layout
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2Config(
        vocab_size=53, n_positions=40, n_embd=24, n_layer=2, n_head=3, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    yield "gpt2", transformers.GPT2LMHeadModel(hf).eval()  # Conv1D (K, N) weights, tanh GeLU
    llama = transformers.LlamaConfig(
        vocab_size=53, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    yield "llama", transformers.LlamaForCausalLM(llama).eval()  # RMSNorm, rotary, GQA, SwiGLU


def _decode_logits(engine, prompts: torch.Tensor, steps: int) -> list[torch.Tensor]:
    B = prompts.shape[0]
    cache = engine.new_cache(B * 4, 8)
    ids = list(range(B))
    for i in ids:
        cache.add_sequence(i)
    with torch.no_grad():
        logits = engine.prefill_many(prompts, cache, ids, last_only=True)[:, -1]
        out = [logits]
        for _ in range(steps):
            logits = engine.decode(logits.argmax(-1), cache, ids)
            out.append(logits)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_decode_plan_equals_the_block_loop(gpt_module, monkeypatch, dtype, batch):
    for name, model in _models(gpt_module):
        engine, _ = init_inference(model, dtype=dtype)
        vocab = engine.vocab_size
        prompts = torch.randint(0, vocab, (batch, 5), generator=torch.Generator().manual_seed(1))
        got = _decode_logits(engine, prompts, 6)
        plan = engine._plans[(batch, id(kernels.load_op()), threading.get_ident())]
        # fp32 linears take at most 8 rows in the op (kernels.linear's torch path beyond): no plan
        assert (plan is None) == (dtype == torch.float32 and batch > 8), name
        with monkeypatch.context() as m:
            m.setattr(decode_plan.GPTDecodePlan, "build", staticmethod(lambda *a: None))
            engine._plans.clear()
            want = _decode_logits(engine, prompts, 6)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), name
        engine._plans[(1, 0)] = None
        engine.to("cpu")  # a move drops the plans (their weight addresses would be stale)
        assert engine._plans == {}
