"""init_inference on Hugging Face's GPT2LMHeadModel (small random config, built locally: no download)."""

from __future__ import annotations

import pytest
import torch

from minispeed.inference import SamplingConfig, generate, init_inference
from minispeed.inference.quantize import quantize_per_channel

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


def _gpt2(activation: str = "gelu_new"):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=53, n_positions=32, n_embd=24, n_layer=2, n_head=3, activation_function=activation,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_injected_gpt2_logits_equal_transformers(activation, rel_close):
    model = _gpt2(activation)
    engine, report = init_inference(model)
    assert report.policy == "hf-gpt2" and report.replaced == ("blocks.0", "blocks.1")
    # Conv1D weights are shared as transposed views, not copied
    w = model.transformer.h[0].attn.c_attn.weight
    assert engine.blocks[0].qkv.weight.data_ptr() == w.data_ptr()
    idx = torch.randint(0, 53, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(idx).logits
        got = engine(idx)
    rel_close(got, want)


def test_gpt2_cached_generation_equals_recomputation(rel_close):
    engine, _ = init_inference(_gpt2())
    prompts = [[1, 2, 3, 4, 5], [9]]
    cfg = SamplingConfig(max_new_tokens=8, temperature=0.9, top_k=10, seed=1)
    assert generate(engine, prompts, cfg, kv_block_size=4) == generate(
        engine, prompts, cfg, use_cache=False
    )


def test_gpt2_int8_holds_conv1d_weights_as_rows_and_decodes_as_the_reference(monkeypatch):
    # Conv1D stores W transposed; the int8 copy must be (N, K) contiguous, or the kernel's wrapper
    # copied the whole weight on every call (GPT-2 int8 decode ran at 0.4x transformers for it).
    model = _gpt2()
    engine, _ = init_inference(model, dtype=torch.int8)
    conv = model.transformer.h[1].mlp.c_fc
    q = engine.blocks[1].fc.weight_q
    assert q.is_contiguous() and torch.equal(q, quantize_per_channel(conv.weight.t())[0])
    prompts, cfg = [[1, 2, 3, 4, 5], [9]], SamplingConfig(max_new_tokens=8)
    got = generate(engine, prompts, cfg, kv_block_size=4)
    monkeypatch.setenv("MINISPEED_DISABLE_OPS", "inference_kernels")
    assert got == generate(engine, prompts, cfg, kv_block_size=4)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_kept_gpt2_blocks_stay_causal(attn, rel_close):
    # Kept blocks got no attention mask: with eager attention they attended to future tokens.
    model = _gpt2()
    model.config._attn_implementation = attn
    engine, report = init_inference(model, replace_with_kernel_inject=False)
    assert report.replaced == () and "replace_with_kernel_inject=False" in report.kept[0]
    idx = torch.randint(0, 53, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        rel_close(engine(idx), model(idx).logits)
