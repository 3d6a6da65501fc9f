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


def test_out_of_range_token_ids_fail_alone_at_submit(engine):
    # vocab_size 29: 29 and -1 are no token; an IndexError in step() used to leave the request
    # done=False, error=None and its KV block taken
    batcher = ContinuousBatcher(engine, num_blocks=4, kv_block_size=4, max_batch=4)
    good = batcher.submit([1, 2], SamplingConfig(max_new_tokens=4))
    too_high = batcher.submit([3, 29, 4], SamplingConfig(max_new_tokens=2))
    negative = batcher.submit([-1], SamplingConfig(max_new_tokens=2))
    not_int = batcher.submit([1, 2.5], SamplingConfig(max_new_tokens=2))
    also_good = batcher.submit([5], SamplingConfig(max_new_tokens=3, temperature=1.0, seed=4))
    results = batcher.run()
    assert "token id 29 at position 1 is outside the vocabulary [0, 29)" in results[too_high].error
    assert "token id -1 at position 0 is outside the vocabulary" in results[negative].error
    assert "position 1 is 2.5, not an int" in results[not_int].error
    for rid in (too_high, negative, not_int):
        assert results[rid].done and results[rid].tokens == []
    want = generate(engine, [[1, 2]], SamplingConfig(max_new_tokens=4))[0]
    assert results[good].error is None and results[good].tokens == want
    alone = generate(engine, [[5]], SamplingConfig(max_new_tokens=3, temperature=1.0, seed=4))
    assert results[also_good].tokens == alone[0]
    assert batcher.cache.free_blocks == 4 and not batcher.cache.tables


class _Poisoned:
    """Wraps the engine: prefill of a prompt starting with 13, and any decode step that includes
    sequence `poisoned_decode`, raise (a stand-in for any per-request failure inside step)."""

    def __init__(self, engine, poisoned_decode: int) -> None:
        self.engine, self.poisoned_decode = engine, poisoned_decode

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def prefill(self, idx, cache, seq_id, **kwargs):
        if int(idx[0]) == 13:
            cache.reserve(seq_id, len(idx))  # fail after taking blocks, as a real failure can
            raise RuntimeError("prefill exploded")
        return self.engine.prefill(idx, cache, seq_id, **kwargs)

    def decode(self, tokens, cache, seq_ids):
        if self.poisoned_decode in seq_ids:
            cache.reserve(self.poisoned_decode, 1)
            raise RuntimeError("decode exploded")
        return self.engine.decode(tokens, cache, seq_ids)


def test_a_request_failing_inside_step_fails_alone_and_frees_its_blocks(engine):
    reqs = [
        ([3, 1, 4], SamplingConfig(max_new_tokens=6)),
        ([13, 2], SamplingConfig(max_new_tokens=3)),  # fails in prefill
        ([2, 7, 1], SamplingConfig(max_new_tokens=5, temperature=0.9, seed=5)),  # fails in decode
        ([8, 8], SamplingConfig(max_new_tokens=4, top_k=3, temperature=1.0, seed=1)),
    ]
    batcher = ContinuousBatcher(_Poisoned(engine, poisoned_decode=2), num_blocks=8,
                                kv_block_size=4, max_batch=4)  # fmt: skip
    ids = [batcher.submit(*r) for r in reqs]
    results = batcher.run()
    assert results[ids[1]].done and "prefill exploded" in results[ids[1]].error
    assert results[ids[2]].done and "decode exploded" in results[ids[2]].error
    for i in (0, 3):
        assert results[ids[i]].error is None and results[ids[i]].done
        assert results[ids[i]].tokens == generate(engine, [reqs[i][0]], reqs[i][1])[0]
    assert (
        batcher.cache.free_blocks == 8 and not batcher.cache.tables and batcher.reserved_blocks == 0
    )


@pytest.mark.parametrize("arg", ["num_blocks", "kv_block_size", "max_batch"])
def test_batcher_sizes_below_one_are_refused_by_name(engine, arg):
    kwargs = {"num_blocks": 4, "kv_block_size": 4, "max_batch": 2, arg: 0}
    with pytest.raises(ValueError, match=f"ContinuousBatcher: {arg} must be an int >= 1, got 0"):
        ContinuousBatcher(engine, **kwargs)
