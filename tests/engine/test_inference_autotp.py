"""`init_inference(model, tensor_parallel={"tp_size": 2})` on Hugging Face families no injection
policy fuses (DeepSpeed's AutoTP without kernel injection): on 2 gloo ranks the model is cut by
its structure (`minispeed.tensor_parallel.auto_plan`) and every rank's logits and greedy
`generate` tokens equal the single-process model's, for Qwen2 (GQA, q/k/v biases, tied head),
OPT (learned positions, `num_heads` divided) and GPT-NeoX (fused per-head `query_key_value`, its
own head `embed_out`), Phi-3 (fused `qkv_proj` of unequal q/k/v widths), Falcon's new decoder
(`query_key_value` grouped per kv head) and Bloom (ALiBi slopes cut per rank). A family the plan
cannot read (Falcon's multi-query layers) is refused on every rank naming the module."""

from __future__ import annotations

import pytest
import torch

from minispeed.core.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

VOCAB = 48
FAMILIES = ("qwen2", "opt", "gpt_neox", "phi3", "falcon", "bloom")


def _model(name: str):
    torch.manual_seed(0)
    t = transformers
    if name == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            tie_word_embeddings=True, pad_token_id=None, bos_token_id=0, eos_token_id=None,
        )).eval()  # fmt: skip
    if name == "opt":
        return t.OPTForCausalLM(t.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
            max_position_embeddings=32, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=0,
            eos_token_id=None,
        )).eval()  # fmt: skip
    if name == "phi3":
        return t.Phi3ForCausalLM(t.Phi3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            pad_token_id=None, bos_token_id=0, eos_token_id=None,
        )).eval()  # fmt: skip
    if name in ("falcon", "falcon_multi_query"):
        grouped = dict(new_decoder_architecture=True, num_kv_heads=2, bias=True)
        return t.FalconForCausalLM(t.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            bos_token_id=0, eos_token_id=None, **(grouped if name == "falcon" else {}),
        )).eval()  # fmt: skip
    if name == "bloom":
        return t.BloomForCausalLM(t.BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=8, bos_token_id=0,
            eos_token_id=None, pad_token_id=None,
        )).eval()  # fmt: skip
    return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=None,
    )).eval()  # fmt: skip


def _prompt() -> torch.Tensor:
    return torch.randint(2, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))


def _body(rank: int, world_size: int) -> dict:
    import minispeed.engine as deepspeed

    out = {}
    for name in FAMILIES:
        model = _model(name)
        engine = deepspeed.init_inference(
            model, tensor_parallel={"tp_size": 2}, dtype=torch.float32
        )
        ids = _prompt()
        with torch.no_grad():
            out[name] = {
                "logits": engine(ids).logits,
                "tokens": engine.generate(ids, max_new_tokens=6, do_sample=False),
                "split": engine.injection_report.replaced,
            }
    for bad, dtype in (("falcon_multi_query", torch.float32), ("qwen2", torch.int8)):
        try:
            deepspeed.init_inference(_model(bad), tensor_parallel={"tp_size": 2}, dtype=dtype)
        except (ValueError, NotImplementedError) as err:
            out[f"refused {bad}"] = str(err)
    return out


def test_init_inference_splits_unfused_families_over_2_ranks():
    results = run_distributed(_body, world_size=2, timeout_s=240)
    for name in FAMILIES:
        model = _model(name)
        ids = _prompt()
        with torch.no_grad():
            want = model(ids).logits
            tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        for got in (r[name] for r in results):
            torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got["tokens"], tokens), name
            # every linear is split but a tied head (Qwen2's, OPT's), which stays whole
            linears = {p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            assert set(got["split"]) == linears - ({"lm_head"} if tied else set()), name
    for r in results:  # on every rank, naming the module or the dtype
        assert "transformer.h.0.self_attention.query_key_value" in r["refused falcon_multi_query"]
        assert "use dtype=torch.float32" in r["refused qwen2"]
