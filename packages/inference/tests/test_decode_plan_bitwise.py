"""The decode step's blocks as raw op calls (decode_plan.py: GPT, GPT-2, LLaMA) give the block
loop's logits bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from minispeed.inference import decode_plan, init_inference, kernels

pytestmark = pytest.mark.timeout(300)


def _models(gpt_module):
    torch.manual_seed(0)
    cfg = gpt_module.GPTConfig(vocab_size=31, block_size=40, n_layer=2, n_head=2, n_embd=32)
    yield "gpt", gpt_module.GPT(cfg).eval()  # nn.Linear weights: the op's (N, K) layout
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2Config(
        vocab_size=53, n_positions=40, n_embd=24, n_layer=2, n_head=3, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=0, bos_token_id=0,
    )  # fmt: skip
    yield "gpt2", transformers.GPT2LMHeadModel(hf).eval()  # Conv1D (K, N) weights, tanh GeLU
    llama = transformers.LlamaConfig(
        vocab_size=53, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    yield "llama", transformers.LlamaForCausalLM(llama).eval()  # RMSNorm, rotary, GQA, SwiGLU


def _decode_logits(engine, prompts: torch.Tensor, steps: int) -> list[torch.Tensor]:
    B = prompts.shape[0]
    cache = engine.new_cache(B * 4, 8)
    ids = list(range(B))
    for i in ids:
        cache.add_sequence(i)
    with torch.no_grad():
        logits = engine.prefill_many(prompts, cache, ids, last_only=True)[:, -1]
        out = [logits]
        for _ in range(steps):
            logits = engine.decode(logits.argmax(-1), cache, ids)
            out.append(logits)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("batch", [1, 3, 9])
def test_decode_plan_equals_the_block_loop(gpt_module, monkeypatch, dtype, batch):
    for name, model in _models(gpt_module):
        engine, _ = init_inference(model, dtype=dtype)
        vocab = engine.vocab_size
        prompts = torch.randint(0, vocab, (batch, 5), generator=torch.Generator().manual_seed(1))
        got = _decode_logits(engine, prompts, 6)
        plan = engine._plans[(batch, id(kernels.load_op()), threading.get_ident())]
        # fp32 linears take at most 8 rows in the op (kernels.linear's torch path beyond): no plan
        assert (plan is None) == (dtype == torch.float32 and batch > 8), name
        with monkeypatch.context() as m:
            m.setattr(decode_plan.GPTDecodePlan, "build", staticmethod(lambda *a: None))
            engine._plans.clear()
            want = _decode_logits(engine, prompts, 6)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), name
        engine._plans[(1, 0)] = None
        engine.to("cpu")  # a move drops the plans (their weight addresses would be stale)
        assert engine._plans == {}


@pytest.mark.parametrize("level", ["scalar", "avx2", "avx512"])
def test_gpt_blocks_run_in_one_op_call_at_every_simd_level(gpt_module, monkeypatch, level):
    """A GPT decode step's blocks are one `op.gpt_layers` call (Note [the GPT blocks in one call]
    in csrc/kernels/decode_step.cpp), none of the per-kernel calls the Python plan made, and its
    logits are the block loop's bit for bit at each SIMD level's build."""
    from minispeed.core.op_builder import SIMD_ENV, SimdLevel, cpu_simd_level
    from minispeed.inference.kernels import InferenceKernelsBuilder

    monkeypatch.setenv(SIMD_ENV, level)
    if (
        not InferenceKernelsBuilder().is_compatible()[0]
        or SimdLevel[level.upper()] > cpu_simd_level()
    ):
        pytest.skip(f"no {level} build on this machine")
    op = kernels.load_op()
    if op is None:
        pytest.skip(f"the {level} build failed; see python -m minispeed.core.report")
    model = dict(_models(gpt_module))["gpt2"]
    engine, _ = init_inference(model, dtype=torch.int8)
    prompts = torch.randint(
        0, engine.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1)
    )
    calls: dict[str, int] = {}

    def counted(name, fn):
        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)

        return call

    for name in ("gpt_layers", "decode_attention"):
        monkeypatch.setattr(op, name, counted(name, getattr(op, name)))
    got = _decode_logits(engine, prompts, 4)
    # per decode step: the blocks in one call; the final norm and the head outside it
    assert calls == {"gpt_layers": 4}, calls
    with monkeypatch.context() as m:
        m.setattr(decode_plan.GPTDecodePlan, "build", staticmethod(lambda *a: None))
        engine._plans.clear()
        want = _decode_logits(engine, prompts, 4)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
