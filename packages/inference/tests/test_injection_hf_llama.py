"""init_inference on Hugging Face's LlamaForCausalLM (small random config with grouped-query attention)."""

from __future__ import annotations

import pytest
import torch

from minispeed.inference import SamplingConfig, generate, init_inference
from minispeed.inference.kv_cache import kv_cache_bytes

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


def _llama(**overrides):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40,
        bos_token_id=0, eos_token_id=1, pad_token_id=None, **overrides,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def _greedy_transformers(model, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


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


def test_llama_cache_holds_each_kv_head_once():
    # 4 query heads over 2 K/V heads of 8 dims, 2 layers: the cache is half a repeated one.
    engine, _ = init_inference(_llama())
    cache = engine.new_cache(num_blocks=3, block_size=4)
    assert cache.k[0].shape == cache.v[1].shape == (3, 4, 2, 8)
    assert sum(t.numel() * 4 for t in cache.k + cache.v) == kv_cache_bytes(2, 3, 4, 2, 8)


def test_llama_decoding_past_its_positions_is_a_clear_error():
    # The rotary kernel no longer checks positions per layer (Note [decode step plan]).
    engine, _ = init_inference(_llama())
    cache = engine.new_cache(num_blocks=11, block_size=4)
    cache.add_sequence(0)  # 44 slots > 40 positions
    engine.prefill(torch.ones(40, dtype=torch.long), cache, 0)
    with pytest.raises(ValueError, match="position 40 is past the model's 40 positions"):
        engine.decode(torch.ones(1, dtype=torch.long), cache, [0])


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


# Each case keeps every layer unfused, for the reason the report must give.
_KEPT = {
    "no-injection": ({}, False, "replace_with_kernel_inject=False"),
    "attention_bias": ({"attention_bias": True}, True, "attention_bias=True"),
    "mlp_bias": ({"mlp_bias": True}, True, "mlp_bias=True"),
    "dynamic-rope": (
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        True,
        "rope_type 'dynamic' rescales with the sequence length",
    ),
}


@pytest.mark.parametrize("case", list(_KEPT))
def test_kept_llama_layers_compute_what_transformers_computes(case, rel_close):
    # Kept decoder layers used to be called without their rotary embeddings and fail.
    overrides, inject, reason = _KEPT[case]
    model = _llama(**overrides)
    engine, report = init_inference(model, replace_with_kernel_inject=inject)
    assert report.replaced == () and len(report.kept) == 2
    assert all(reason in k for k in report.kept), report.kept
    idx = torch.randint(0, 61, (2, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        rel_close(engine(idx), model(idx).logits)
    cfg = SamplingConfig(max_new_tokens=6)
    assert generate(engine, [[2, 3, 4]], cfg, use_cache=False)[0] == _greedy_transformers(
        model, [2, 3, 4], 6
    )
    with pytest.raises(RuntimeError, match=f"not replaced by a fused block \\(.*{reason[:12]}"):
        generate(engine, [[2, 3, 4]], cfg)


_SCALED_ROPE = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 20},
}  # fmt: skip


@pytest.mark.parametrize("rope", list(_SCALED_ROPE))
def test_scaled_rope_llama_is_fused_and_equals_transformers(rope, rel_close):
    # Used to be refused with "no injection policy recognises LlamaForCausalLM".
    model = _llama(rope_scaling=_SCALED_ROPE[rope])
    engine, report = init_inference(model)
    assert report.replaced == ("blocks.0", "blocks.1"), report
    idx = torch.randint(0, 61, (2, 37), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        rel_close(engine(idx), model(idx).logits)
    cfg = SamplingConfig(max_new_tokens=12)
    prompts = [[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [9]]
    cached = generate(engine, prompts, cfg, kv_block_size=4)
    assert cached == [_greedy_transformers(model, p, 12) for p in prompts]
