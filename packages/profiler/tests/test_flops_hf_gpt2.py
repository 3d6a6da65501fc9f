"""On a Hugging Face GPT2LMHeadModel (random config; optional: skipped without transformers)
the forward count equals the analytic count within 0.1%, attention counted as causal."""

import pytest
import torch

from minispeed.profiler import FlopsProfiler, formulas

transformers = pytest.importorskip("transformers")

B, T, L, C, H, V = 2, 32, 2, 64, 4, 101


def test_gpt2_forward_matches_the_analytic_count_and_counts_tied_weights_once():
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=H, attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    idx = torch.randint(0, V, (B, T))
    with FlopsProfiler(model) as prof:
        model(idx, labels=idx)
    r = prof.result()
    # gelu_new, the tanh approximation, runs as 8 element-wise operators.
    analytic = formulas.gpt_forward(
        batch=B, seq=T, n_layer=L, n_embd=C, n_head=H, vocab=V, gelu_flops=8
    )
    assert r.forward.macs == analytic.macs  # matmuls and causal attention: exact
    assert abs(r.forward.flops - analytic.flops) <= 1e-3 * analytic.flops
    assert r.unknown_ops == {}
    assert model.lm_head.weight is model.transformer.wte.weight
    assert r.root.params == sum(p.numel() for p in model.parameters())  # the tied head once
    assert r.module("lm_head").params == V * C
