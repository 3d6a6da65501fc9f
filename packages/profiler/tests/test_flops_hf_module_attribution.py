"""Hugging Face GPT-2 and LLaMA (random configs; skipped without transformers): every projection
and MLP is charged, forward and backward, what it costs run alone under `FlopCounterMode`, and
the rows add up to the total."""

import pytest
import torch
from test_flops_module_attribution import _alone_matmul_flops, _exclusive_rows_sum_to_the_total

from minispeed.profiler import FlopsProfiler

transformers = pytest.importorskip("transformers")

B, T, L, C, H, V = 2, 8, 2, 32, 4, 61


def _profile_step(model):
    torch.manual_seed(1)
    idx = torch.randint(0, V, (B, T))
    model.zero_grad(set_to_none=True)
    with FlopsProfiler(model) as prof:
        model(idx, labels=idx).loss.backward()
    model.zero_grad(set_to_none=True)
    return prof.result()


def _assert_alone(r, model, name, fan_in):
    row = r.module(name)
    assert row.calls == 1, name
    fwd, bwd = _alone_matmul_flops(model.get_submodule(name), (B, T, fan_in))
    assert (2 * row.forward.macs, 2 * row.backward.macs) == (fwd, bwd), name


def test_llama_projections_and_gated_mlp_are_each_charged_their_own_work():
    cfg = transformers.LlamaConfig(
        vocab_size=V, hidden_size=C, intermediate_size=3 * C, num_hidden_layers=L,
        num_attention_heads=H, num_key_value_heads=H // 2, max_position_embeddings=T,
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    r = _profile_step(model)
    assert r.unknown_ops == {}
    for i in range(L):
        layer = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _assert_alone(r, model, f"{layer}.self_attn.{proj}", C)
        for proj in ("gate_proj", "up_proj"):
            _assert_alone(r, model, f"{layer}.mlp.{proj}", C)
        _assert_alone(r, model, f"{layer}.mlp.down_proj", 3 * C)
        _assert_alone(r, model, f"{layer}.mlp", C)
    _assert_alone(r, model, "lm_head", C)
    _exclusive_rows_sum_to_the_total(r)


def test_gpt2_attention_and_mlp_are_each_charged_their_own_work():
    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=H, attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)  # train mode: the Dropout(p=0)s return their input
    r = _profile_step(model)
    assert r.unknown_ops == {}
    for i in range(L):
        block = f"transformer.h.{i}"
        _assert_alone(r, model, f"{block}.attn.c_attn", C)
        _assert_alone(r, model, f"{block}.attn.c_proj", C)
        _assert_alone(r, model, f"{block}.mlp", C)
        for drop in ("attn.resid_dropout", "mlp.dropout"):
            row = r.module(f"{block}.{drop}")
            assert row.forward.flops == row.backward.flops == 0, drop
    _assert_alone(r, model, "lm_head", C)
    _exclusive_rows_sum_to_the_total(r)


def test_get_model_profile_on_gpt2_with_kwargs_gives_the_analytic_forward():
    from minispeed.profiler import formulas, get_model_profile

    cfg = transformers.GPT2Config(
        vocab_size=V, n_positions=T, n_embd=C, n_layer=L, n_head=H, attn_implementation="sdpa",
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    idx = torch.randint(0, V, (B, T))
    flops, macs, params = get_model_profile(
        model, kwargs={"input_ids": idx}, print_profile=False, as_string=False
    )
    analytic = formulas.gpt_forward(
        batch=B, seq=T, n_layer=L, n_embd=C, n_head=H, vocab=V, loss=False, gelu_flops=8
    )
    assert macs == analytic.macs
    assert abs(flops - analytic.flops) <= 1e-3 * analytic.flops
    assert params == sum(p.numel() for p in model.parameters())  # the tied head once
    assert model.training
