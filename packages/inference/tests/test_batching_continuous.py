"""Continuous batching: requests joining at any time give the tokens they give alone; bad ones fail alone."""

from __future__ import annotations

import pytest
import torch

from minispeed.inference import SamplingConfig, generate, init_inference
from minispeed.inference.batching import ContinuousBatcher

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def engine(gpt_module):
    torch.manual_seed(1)
    cfg = gpt_module.GPTConfig(vocab_size=29, block_size=32, n_layer=2, n_head=2, n_embd=16)
    return init_inference(gpt_module.GPT(cfg).eval())[0]


def test_requests_joining_midway_equal_running_each_alone(engine):
    reqs = [
        ([3, 1, 4], SamplingConfig(max_new_tokens=9)),
        ([1, 5, 9, 2, 6, 5, 3, 5], SamplingConfig(max_new_tokens=5, temperature=1.1, seed=7)),
        ([8], SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=4, seed=2)),
        ([2, 7, 1, 8, 2, 8], SamplingConfig(max_new_tokens=7, top_p=0.9, temperature=1.0, seed=3)),
        ([4, 4], SamplingConfig(max_new_tokens=3)),
    ]
    # 2 slots and a pool of 7 blocks of 4 tokens (requests need 3, 4, 4, 4, 2): requests queue
    # and join as others leave
    batcher = ContinuousBatcher(engine, num_blocks=7, kv_block_size=4, max_batch=2)
    ids = [batcher.submit(*reqs[0]), batcher.submit(*reqs[1])]
    batcher.step()
    batcher.step()
    ids += [batcher.submit(*r) for r in reqs[2:]]  # arrive while the first two run
    joined_midway = False
    while batcher.waiting or batcher.live:
        before = {r.rid: len(r.result.tokens) for r in batcher.live}
        batcher.step()
        now = {r.rid for r in batcher.live}
        # a request admitted this step decodes beside one that was already generating
        joined_midway |= bool(now - before.keys()) and bool(now & before.keys())
    assert joined_midway
    results = batcher.results
    for rid, (prompt, cfg) in zip(ids, reqs):
        assert results[rid].error is None and results[rid].done
        assert results[rid].tokens == generate(engine, [prompt], cfg)[0]
    assert batcher.cache.free_blocks == 7  # every block came back


def test_a_bad_request_fails_alone(engine):
    batcher = ContinuousBatcher(engine, num_blocks=3, kv_block_size=4, max_batch=4)
    good = batcher.submit([1, 2], SamplingConfig(max_new_tokens=4))
    too_long = batcher.submit([1] * 30, SamplingConfig(max_new_tokens=5))
    too_big = batcher.submit([1] * 10, SamplingConfig(max_new_tokens=5))  # 4 blocks > pool of 3
    empty = batcher.submit([], SamplingConfig(max_new_tokens=1))
    results = batcher.run()
    assert "exceeds the model's 32 positions" in results[too_long].error
    assert "needs 4 KV blocks but the whole cache has 3" in results[too_big].error
    assert "empty prompt" in results[empty].error
    assert results[good].error is None
    assert results[good].tokens == generate(engine, [[1, 2]], SamplingConfig(max_new_tokens=4))[0]
