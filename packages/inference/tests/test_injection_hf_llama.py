"""init_inference on Hugging Face's LlamaForCausalLM (small random config with grouped-query attention)."""

from __future__ import annotations

import pytest
import torch

from minispeed.inference import SamplingConfig, generate, init_inference

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40,
        bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def test_injected_llama_logits_equal_transformers(rel_close):
    model = _llama()
    engine, report = init_inference(model)
    assert report.policy == "hf-llama" and report.replaced == ("blocks.0", "blocks.1")
    idx = torch.randint(0, 61, (2, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(idx).logits
        got = engine(idx)
    rel_close(got, want)


def test_llama_cached_generation_equals_recomputation():
    engine, _ = init_inference(_llama())
    prompts = [[2, 3, 4, 5, 6, 7], [9]]
    for cfg in (
        SamplingConfig(max_new_tokens=9),
        SamplingConfig(max_new_tokens=9, temperature=1.0, top_p=0.9),
    ):
        assert generate(engine, prompts, cfg, kv_block_size=4) == generate(
            engine, prompts, cfg, use_cache=False
        )


def test_llama_int8_weights_are_smaller_and_logits_stay_close():
    from minispeed.inference import weight_bytes

    model = _llama()
    engine, _ = init_inference(model, dtype=torch.int8)
    # N·K + 4N bytes against 4·N·K per linear: 3.6× at K = 32 (and 44 for down_proj)
    assert weight_bytes(model.model.layers) / weight_bytes(engine.blocks) > 3.5
    idx = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = model(idx).logits, engine(idx)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
