"""`minispeed.engine.init_inference` (DeepSpeed's call): returns the engine, not a tuple, whose
logits equal the original model's; config and keyword arguments merge (keywords win); DeepSpeed's
other keys are accepted at their defaults and refused, by name, elsewhere."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from minispeed.engine.inference import init_inference

ROOT = Path(__file__).resolve().parents[2]


def _gpt():
    spec = importlib.util.spec_from_file_location("example_gpt", ROOT / "examples" / "gpt.py")
    gpt = sys.modules.setdefault("example_gpt", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(gpt)  # registered first: its dataclasses look their module up
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab_size=37, block_size=24, n_layer=2, n_head=3, n_embd=24)
    return gpt.GPT(cfg).eval()


def test_init_inference_returns_the_engine_with_the_models_logits():
    model = _gpt()
    engine = init_inference(
        model, config={"dtype": "int8", "enable_cuda_graph": False}, dtype=torch.float32,
        replace_with_kernel_inject=True,
    )  # fmt: skip
    assert engine.injection_report.replaced == ("blocks.0", "blocks.1")
    assert engine.injection_report.dtype == torch.float32  # the keyword won over the config
    idx = torch.randint(0, 37, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = model(idx)
        got = engine(idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,error,word",
    [
        ({"enable_cuda_graph": True}, NotImplementedError, "enable_cuda_graph"),
        ({"dtype": "fp16"}, TypeError, "fp16"),
        ({"replace_with_kernal_inject": True}, ValueError, "replace_with_kernel_inject"),
    ],
)
def test_unsupported_options_are_refused_by_name(kwargs, error, word):
    with pytest.raises(error, match=word):
        init_inference(_gpt(), **kwargs)


def _hf_models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                   bos_token_id=1, eos_token_id=2)
    )  # fmt: skip
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)
    )  # fmt: skip
    return [gpt2.eval(), llama.eval()]


@pytest.mark.parametrize("which", [0, 1], ids=["gpt2", "llama"])
def test_engine_generate_is_transformers_generate(which):
    """DeepSpeed's engine.generate is the model's own generate: greedy calls run on the fused
    model and give transformers' tensor (left padding, an early end-of-sequence padded after,
    max_length); sampling, penalties and beams run the model's own generate."""
    from minispeed.inference import fused_refusal

    model = _hf_models()[which]
    engine = init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    x = torch.randint(3, 100, (3, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(x)
    mask[0, :2] = mask[1, :1] = 0
    padded = x.masked_fill(mask == 0, 0)
    first = model.generate(x, max_new_tokens=8, pad_token_id=0)
    calls = [
        ((x,), {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}),
        ((), {"input_ids": padded, "attention_mask": mask, "max_new_tokens": 8, "pad_token_id": 0}),
        # an end-of-sequence id the first row emits at its third step: it stops, is padded
        ((x,), {"max_new_tokens": 12, "eos_token_id": int(first[0, 8]), "pad_token_id": 0}),
        ((x,), {"max_length": 10, "pad_token_id": 0}),
    ]
    for args, kwargs in calls:
        assert fused_refusal(engine.fused, model, *args, **kwargs) is None, kwargs
        with torch.no_grad():
            assert torch.equal(engine.generate(*args, **kwargs), model.generate(*args, **kwargs))
    eos = int(first[0, 8])
    row = engine.generate(x, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)[0, 6:].tolist()
    assert row.index(eos) < len(row) - 1 and set(row[row.index(eos) + 1 :]) == {0}
    refusals = {
        "do_sample=True": {"do_sample": True, "top_k": 5},
        "repetition_penalty": {"repetition_penalty": 1.2},
        "num_beams=2": {"num_beams": 2},
        "streamer": {"streamer": object()},
    }
    for word, kwargs in refusals.items():
        assert word in fused_refusal(engine.fused, model, x, **kwargs)
    torch.manual_seed(5)
    want = model.generate(x, max_new_tokens=5, do_sample=True, top_k=5, pad_token_id=0)
    torch.manual_seed(5)
    got = engine.generate(x, max_new_tokens=5, do_sample=True, top_k=5, pad_token_id=0)
    assert torch.equal(got, want)
    # engine(ids) is the model's output class; the model's attributes answer through the engine
    with torch.no_grad():
        torch.testing.assert_close(engine(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            engine(padded, attention_mask=mask).logits,
            model(padded, attention_mask=mask).logits,
        )
    assert engine.module is model and engine.config is model.config


def test_a_transformers_pipeline_runs_on_the_engine(monkeypatch):
    """DeepSpeed's tutorial: `generator.model = deepspeed.init_inference(generator.model, ...)`;
    the pipeline's greedy calls then run on the fused model and give the same text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    import minispeed.inference.hf_generation as hf_generation

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="w0", pad_token="w0", eos_token="w2", bos_token="w1"
    )
    generator = pipeline(
        "text-generation", model=_hf_models()[0], tokenizer=tokenizer, device="cpu"
    )
    prompts = ["w5 w6 w7", "w9 w10"]
    want = generator(prompts, max_new_tokens=6, do_sample=False)
    generator.model = init_inference(generator.model, replace_with_kernel_inject=True)
    plans = []
    plan = hf_generation._plan
    monkeypatch.setattr(hf_generation, "_plan", lambda *a: plans.append(plan(*a)) or plans[-1])
    assert generator(prompts, max_new_tokens=6, do_sample=False) == want
    assert plans and not any(isinstance(p, str) for p in plans)  # the fused path ran


def test_a_model_without_a_policy_runs_as_written(caplog, monkeypatch):
    """As DeepSpeed runs a model it has no injection policy for (an OPT here): the engine's
    logits and `generate` are the model's own, with a warning naming it; int8 is refused."""
    from transformers import OPTConfig, OPTForCausalLM

    from minispeed.core.logging import get_logger

    monkeypatch.setattr(get_logger(), "propagate", True)  # let caplog see minispeed's records
    torch.manual_seed(0)
    model = OPTForCausalLM(
        OPTConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                  num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16)
    ).eval()  # fmt: skip
    engine = init_inference(model, dtype=torch.float32, replace_with_kernel_inject=True)
    assert any("OPTForCausalLM" in r.getMessage() for r in caplog.records)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(engine(ids).logits, model(ids).logits, rtol=0, atol=0)
        want = model.generate(ids, max_new_tokens=3, do_sample=False)
        torch.testing.assert_close(engine.generate(ids, max_new_tokens=3, do_sample=False), want)
    with pytest.raises(ValueError, match="no injection policy recognises OPTForCausalLM"):
        init_inference(model, dtype=torch.int8)
    # a tensor-parallel size of 1 splits nothing (DeepSpeed's scripts write it out): the same
    for one in ({"tp_size": 1}, {"tp_size": 1, "enabled": True}):
        with torch.no_grad():
            got = init_inference(model, dtype=torch.float32, tensor_parallel=one).generate(
                ids, max_new_tokens=3, do_sample=False
            )
        torch.testing.assert_close(got, want)
