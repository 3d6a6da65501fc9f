"""Hugging Face models built under zero.Init: their post-construction initialiser works.

``GPT2LMHeadModel(config)`` and ``LlamaForCausalLM(config)`` initialise their weights in
``post_init()``, after the modules were built and partitioned by zero.Init; that used to raise
ParameterNotGatheredError. Now the initialiser's touches are gathered and written back module by
module (stage3/init_writes.py). On 2 ranks, from small configs (no download), each model built
under Init must hold exactly the weights of the same model built normally from the same seed,
stay within Init's memory bound while building (every storage counted by StorageProbe), and
give the same loss through zero.shard as the normal build.
"""

from __future__ import annotations

import pytest
import torch
from stage3_testlib import AllocatorTrace
from torch import nn

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.stage3 import GatheredParameters, Init

transformers = pytest.importorskip("transformers")


def _build(kind: str) -> tuple[nn.Module, nn.Module, nn.ModuleList]:
    """(model, its base model, its decoder blocks) from a small config."""
    import transformers

    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=4, n_embd=64, n_head=4, vocab_size=101, n_positions=32, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
        return model, model.transformer, model.transformer.h
    cfg = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=101, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    return model, model.model, model.model.layers


_LATE_FREES = 32 * 1024


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _bound(kind: str, world_size: int) -> tuple[int, int]:
    """(bytes after Init, peak bound): each parameter's shard (ceil(n/N) elements) + buffers, plus
    what Init holds unpartitioned at
    once: one decoder block, or the base model's own children (embeddings, final norm), which
    wait for the base model's __init__ to return (Note [when Init partitions a module])."""
    torch.manual_seed(0)
    model, base, blocks = _build(kind)
    params = list(model.parameters())
    buffers = _nbytes(model.buffers())
    share = sum(-(-p.numel() // world_size) * p.element_size() for p in params) + buffers
    own = [c for c in base.children() if not isinstance(c, nn.ModuleList)]
    largest = max(_nbytes(blocks[0].parameters()), sum(_nbytes(c.parameters()) for c in own))
    return share, share + largest


def _loss(model: nn.Module) -> torch.Tensor:
    model.eval()  # no dropout: the two runs draw different random numbers
    ids = torch.arange(24).reshape(2, 12) * 7 % 101
    return model(input_ids=ids, labels=ids).loss


def _body(rank: int, world_size: int, kind: str) -> dict:
    # One build before the measured ones: whatever the library creates once per process (lazy
    # caches) then exists already, so `net` counts what Init holds, whichever tests this pooled
    # worker ran before.
    _build(kind)
    nets, peaks, model = [], [], None
    for _ in range(2):  # AllocatorTrace's note: the smallest of two builds
        del model  # freed before the next trace, which would count its frees
        torch.manual_seed(rank)  # ranks seeded differently: the values must be rank 0's
        if rank == 0:
            torch.manual_seed(0)
        with AllocatorTrace() as trace, Init():  # the collector off, never run
            model, _, _ = _build(kind)
        nets.append(trace.net)
        peaks.append(trace.peak)
    built = dict(net=min(nets), peak=min(peaks), nets=nets)
    torch.manual_seed(0)
    plain, _, _ = _build(kind)
    with GatheredParameters(list(model.parameters())):
        differ = [
            name
            for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True)
            if not torch.equal(p, q)
        ]
    opt = zero.shard(
        model, torch.optim.SGD(model.parameters(), lr=0.0), config=zero.ZeroConfig(stage=3)
    )
    loss = _loss(model).item()
    opt.strategy.close()
    return dict(built=built, differ=differ, loss=loss, plain_loss=_loss(plain).item())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_model_built_under_init_equals_normal_build(kind: str) -> None:
    world_size = 2
    share, peak_bound = _bound(kind, world_size)
    results = run_distributed(_body, world_size=world_size, args=(kind,), timeout_s=300)
    for rank, res in enumerate(results):
        assert res["differ"] == [], (rank, res["differ"])
        # Init holds its share, to within _LATE_FREES: a few small frees land after the trace
        # closes (gloo's worker thread), 256 B - 16 KiB over the share in 3 of 14 runs, on the
        # code of stop 41 as on this one; a decoder block's full values left behind (~74 KiB
        # over the share here, the bug this catches was MBs) still fail.
        assert share <= res["built"]["net"] <= share + _LATE_FREES, (rank, res["built"], share)
        assert res["built"]["peak"] <= peak_bound, (rank, res["built"], peak_bound)
        assert abs(res["loss"] - res["plain_loss"]) <= 1e-5 * abs(res["plain_loss"]), res
