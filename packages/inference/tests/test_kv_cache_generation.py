"""Paged KV cache: generation with the cache gives the tokens of full recomputation; pool accounting."""

from __future__ import annotations

import pytest
import torch

from minispeed.inference import (
    CacheFullError,
    PagedKVCache,
    SamplingConfig,
    generate,
    init_inference,
    kv_cache_bytes,
)

pytestmark = pytest.mark.timeout(300)

# mixed lengths across block edges; two of length 3, prefilled together in one forward
PROMPTS = [[1, 5, 9], [2], [7, 7, 7, 7, 7, 3, 1, 0, 4, 4, 2], [4, 0, 6]]


@pytest.fixture
def engine(gpt_module):
    torch.manual_seed(0)
    cfg = gpt_module.GPTConfig(vocab_size=31, block_size=40, n_layer=2, n_head=2, n_embd=16)
    model = gpt_module.GPT(cfg).eval()
    return model, init_inference(model)[0]


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(max_new_tokens=12),  # greedy
        SamplingConfig(max_new_tokens=12, temperature=1.3, seed=3),
        SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=5, seed=4),
        SamplingConfig(max_new_tokens=12, temperature=1.0, top_p=0.8, seed=5),
    ],
    ids=["greedy", "temperature", "top_k", "top_p"],
)
def test_cached_tokens_equal_recomputed_tokens(engine, cfg):
    model, inf = engine
    cached = generate(inf, PROMPTS, cfg, use_cache=True, kv_block_size=4)
    recomputed = generate(inf, PROMPTS, cfg, use_cache=False)
    original = generate(model, PROMPTS, cfg, use_cache=False)  # eager GPT, no fused kernels
    assert cached == recomputed == original
    assert all(len(o) == 12 for o in cached)


def test_greedy_matches_the_models_own_generate(engine):
    model, inf = engine
    prompt = torch.tensor([PROMPTS[0]])
    want = model.generate(prompt, max_new_tokens=9, temperature=0)[0, 3:].tolist()
    assert generate(inf, [PROMPTS[0]], SamplingConfig(max_new_tokens=9)) == [want]


def test_stop_token_ends_a_sequence_alone(engine):
    _, inf = engine
    free = generate(inf, PROMPTS, SamplingConfig(max_new_tokens=10))
    stop = free[0][3]  # the 4th token sequence 0 emits
    out = generate(inf, PROMPTS, SamplingConfig(max_new_tokens=10, stop_tokens=(stop,)))
    first = free[0].index(stop)
    assert out[0] == free[0][: first + 1]
    for got, full in zip(out[1:], free[1:]):  # others stop only at their own stop token
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:cut]


def test_prompt_longer_than_the_cache_or_the_model_is_a_clear_error(engine):
    _, inf = engine
    with pytest.raises(ValueError, match=r"need 4 KV blocks .* cache has 3"):
        generate(
            inf, [[1] * 10], SamplingConfig(max_new_tokens=6), kv_block_size=4, kv_num_blocks=3
        )
    with pytest.raises(ValueError, match="prompt 0 has 38 tokens"):
        generate(inf, [[1] * 38], SamplingConfig(max_new_tokens=3))


def test_decoding_past_the_models_positions_is_a_clear_error(engine):
    # Used to fail inside the position embedding (IndexError); the LLaMA kernels skip their own
    # range check since it moved here (Note [decode step plan]), so this check guards them too.
    _, inf = engine
    cache = inf.new_cache(num_blocks=11, block_size=4)
    cache.add_sequence(0)  # room for 44 > the model's 40 positions
    inf.prefill(torch.ones(40, dtype=torch.long), cache, 0)
    with pytest.raises(ValueError, match="position 40 is past the model's 40 positions"):
        inf.decode(torch.ones(1, dtype=torch.long), cache, [0])


def test_pool_hands_out_and_takes_back_blocks():
    cache = PagedKVCache(n_layer=1, n_head=2, head_dim=4, num_blocks=3, block_size=4)
    assert kv_cache_bytes(1, 3, 4, 2, 4) == sum(t.numel() * 4 for t in cache.k + cache.v)
    cache.add_sequence(0)
    cache.reserve(0, 5)  # 5 tokens -> 2 blocks
    assert cache.tables[0] == [0, 1] and cache.free_blocks == 1
    cache.add_sequence(1)
    with pytest.raises(CacheFullError, match=r"needs 2 more KV blocks .* 1 free of 3"):
        cache.reserve(1, 8)
    assert cache.free_blocks == 1  # a failed reserve takes nothing
    k = torch.randn(5, 2, 4)
    cache.write(0, 0, k, -k)
    cache.advance(0, 5)
    got_k, got_v = cache.gather(0, 0, 5)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    cache.free(0)
    assert cache.free_blocks == 3 and 0 not in cache.tables


def test_prompts_as_a_tensor_of_ids_give_the_tokens_of_the_lists(engine):
    # (B, T) input_ids, as Hugging Face users pass them; used to raise "Boolean value of Tensor"
    _, inf = engine
    cfg = SamplingConfig(max_new_tokens=5, temperature=1.0, seed=2)
    ids = torch.tensor([[1, 5, 9], [4, 0, 6]])
    want = generate(inf, ids.tolist(), cfg)
    assert generate(inf, ids, cfg) == want
    assert generate(inf, ids, cfg, use_cache=False) == want
    assert generate(inf, list(ids), cfg) == want  # a list of 1-D tensors
    with pytest.raises(ValueError, match=r"a \(B, T\) tensor of integer token ids.*shape \(3,\)"):
        generate(inf, torch.tensor([1, 5, 9]), cfg)
    with pytest.raises(ValueError, match="a flat list of token ids: wrap it"):
        generate(inf, [1, 5, 9], cfg)


def test_empty_batch_bad_ids_and_bad_block_size_are_handled(engine):
    _, inf = engine
    cfg = SamplingConfig(max_new_tokens=3)
    assert (
        generate(inf, [], cfg) == []
        and generate(inf, torch.zeros(0, 4, dtype=torch.long), cfg) == []
    )
    with pytest.raises(ValueError, match="kv_block_size must be an int >= 1, got 0"):
        generate(inf, [[1, 2]], cfg, kv_block_size=0)
    with pytest.raises(ValueError, match="kv_num_blocks must be an int >= 1"):
        generate(inf, [[1, 2]], cfg, kv_num_blocks=0)
    with pytest.raises(
        ValueError, match=r"prompt 1: token id 31 at position 0 is outside the vocabulary \[0, 31\)"
    ):
        generate(inf, [[1, 2], [31]], cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
def test_prefill_last_only_is_the_full_prefills_last_row_and_generate_asks_for_it(
    gpt_module, monkeypatch, dtype
):
    # See Note [prefill: the last position's logits only]: generate's prefill used to run the
    # head over every prompt position (B·T rows) to sample from the last one.
    torch.manual_seed(0)
    cfg = gpt_module.GPTConfig(vocab_size=31, block_size=40, n_layer=2, n_head=2, n_embd=16)
    inf = init_inference(gpt_module.GPT(cfg).eval(), dtype=dtype)[0]
    ids = torch.tensor([[1, 5, 9, 2, 2, 7, 3, 0, 4, 4, 1], [4, 0, 6, 6, 1, 2, 3, 8, 9, 9, 5]])
    caches = [inf.new_cache(8, 4), inf.new_cache(8, 4)]
    for c in caches:
        c.add_sequence(0), c.add_sequence(1)
    full = inf.prefill_many(ids, caches[0], [0, 1])
    last = inf.prefill_many(ids, caches[1], [0, 1], last_only=True)
    assert last.shape == (2, 1, cfg.vocab_size)
    if dtype == torch.int8:
        assert torch.equal(last, full[:, -1:])  # int8_linear sums each row alike at any M
    else:  # one row on the streaming kernel, eleven on torch's GEMM
        torch.testing.assert_close(last, full[:, -1:], rtol=1e-5, atol=1e-5)
    for layer in range(cfg.n_layer):  # every position's K and V cached all the same
        assert torch.equal(caches[0].k[layer], caches[1].k[layer])
        assert torch.equal(caches[0].v[layer], caches[1].v[layer])
    one = inf.new_cache(4, 4)
    one.add_sequence(0)
    # One sequence against the same row of two: equal up to the summation order, which torch's
    # kernels may change with the row count on some CPUs (2.2e-8 apart on an AMD EPYC with
    # AVX-512, bit for bit on the hosts this suite passed on before).
    single = inf.prefill(ids[0], one, 0, last_only=True)
    torch.testing.assert_close(single, last[0], rtol=1e-6, atol=1e-6)

    from minispeed.inference import kernels

    head_rows = []
    for name in ("linear", "int8_linear"):
        original = getattr(kernels, name)

        def spy(x, w, *args, original=original):
            if w.shape[0] == cfg.vocab_size:
                head_rows.append(x.numel() // x.shape[-1])
            return original(x, w, *args)

        monkeypatch.setattr(kernels, name, spy)
    generate(inf, ids, SamplingConfig(max_new_tokens=3))
    assert head_rows == [2, 2, 2]  # the prefill's last rows, then two decode steps
