"""Tensor parallelism splits the blocks, not the answer: TP=2 (two gloo processes) gives TP=1's
logits (fp32, ≤ 1e-5 relative) and tokens, for minispeed's GPT, HF GPT-2 and LLaMA (grouped-query
attention), with exactly 2·L all-reduces per forward of the predicted size, half the block
weights and half the cached heads per rank; a TP size that does not fit is a clear error."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from minispeed.core.testing import run_distributed
from minispeed.inference import SamplingConfig, generate, init_inference, weight_bytes
from minispeed.inference.tensor_parallel import TPConfig, allreduce_cost

comm = pytest.importorskip("minispeed.comm")
pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5]]
NEW = 5


def _gpt_module():
    if "minispeed_example_gpt" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "minispeed_example_gpt", REPO / "examples/gpt.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["minispeed_example_gpt"] = module
        spec.loader.exec_module(module)
    return sys.modules["minispeed_example_gpt"]


def _gpt(n_head: int = 4):
    gpt = _gpt_module()
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(vocab_size=37, block_size=24, n_layer=2, n_head=n_head, n_embd=24)
    return gpt.GPT(cfg).eval()


def _idx(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 13), generator=torch.Generator().manual_seed(1))


def _run(engine, vocab: int) -> dict:
    """Logits, greedy and sampled tokens, and the all-reduces one generate call issued."""
    with torch.no_grad():
        logits = engine(_idx(vocab))
    with comm.CommsLogger() as log:
        greedy = generate(engine, PROMPTS, SamplingConfig(max_new_tokens=NEW), kv_block_size=4)
    sampled = generate(
        engine, PROMPTS, SamplingConfig(max_new_tokens=NEW, temperature=1.0, top_k=8)
    )
    records = log.filter("all_reduce")
    return {
        "logits": logits,
        "greedy": greedy,
        "sampled": sampled,
        "calls": len(records),
        "msg": sum(r.msg_bytes for r in records),
        "wire": sum(r.wire_bytes for r in records),
        "heads": engine.n_head,
        "weights": weight_bytes(engine.blocks),
    }


def _gpt_body(rank: int, world_size: int) -> dict:
    engine, report = init_inference(_gpt(), tensor_parallel={"tp_size": 2})
    out = _run(engine, 37)
    out["report"] = str(report)
    int8, _ = init_inference(_gpt(), dtype=torch.int8, tensor_parallel=2)
    with torch.no_grad():
        out["int8_logits"] = int8(_idx(37))
    try:
        init_inference(_gpt(), tensor_parallel=4)
    except ValueError as err:
        out["tile_error"] = str(err)
    return out


def _hf_models():
    import transformers

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=41, n_positions=24, n_embd=24, n_layer=2, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=0, bos_token_id=0,
    )).eval()  # fmt: skip
    torch.manual_seed(1)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=41, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=24,
        bos_token_id=0, eos_token_id=1, pad_token_id=None,
    )).eval()  # fmt: skip
    return {"gpt2": gpt2, "llama": llama}


def _hf_body(rank: int, world_size: int) -> dict:
    grid = comm.ProcessGrid(comm.ProcessTopology(("tensor",), (2,)))  # a caller's own group
    return {
        name: _run(init_inference(m, tensor_parallel={"tp_size": 2, "tp_group": grid})[0], 41)
        for name, m in _hf_models().items()
    }


def _check(results: list[dict], want: dict, n_layer: int, width: int, rel_close) -> None:
    tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (NEW - 1)  # prefills, then decode steps
    calls, msg, wire = allreduce_cost(n_layer, width, tokens, 2)
    for got in results:
        rel_close(got["logits"], want["logits"])
        assert got["greedy"] == want["greedy"] and got["sampled"] == want["sampled"]
        # one all-reduce per block output: 2·L per forward; one prefill per prompt length (the
        # two prompts differ), then NEW - 1 decode steps
        assert got["calls"] == calls * (len(PROMPTS) + NEW - 1)
        assert (got["msg"], got["wire"]) == (msg, wire)
        assert got["heads"] * 2 == want["heads"]  # the KV cache holds half the heads
        assert got["weights"] * 2 == want["weights"]  # each rank holds half of every linear
    assert want["calls"] == 0  # TP=1 never communicates


def test_tp2_gpt_equals_tp1(rel_close):
    results = run_distributed(_gpt_body, world_size=2, timeout_s=240)
    want = _run(init_inference(_gpt())[0], 37)
    _check(results, want, n_layer=2, width=24, rel_close=rel_close)
    assert "tensor-parallel over 2 ranks" in results[0]["report"]
    for got in results:  # int8 shards are quantized on their own: close to fp32, not equal
        err = (got["int8_logits"] - want["logits"]).abs().max()
        assert err < 0.05 * want["logits"].abs().max()
        assert "tp_size=4 does not tile the world of 2 ranks" in got["tile_error"]


def test_tp2_hf_gpt2_and_llama_equal_tp1(rel_close):
    pytest.importorskip("transformers")
    results = run_distributed(_hf_body, world_size=2, timeout_s=240)
    for name, (n_layer, width) in {"gpt2": (2, 24), "llama": (2, 32)}.items():
        want = _run(init_inference(_hf_models()[name])[0], 41)
        _check([r[name] for r in results], want, n_layer, width, rel_close)


def test_tp_size_that_does_not_fit_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"tp_size=2 does not divide the model's heads \(n_head\) \(3\)"
    ):
        init_inference(_gpt(n_head=3), tensor_parallel={"tp_size": 2})
    with pytest.raises(ValueError, match=r"tensor_parallel\.tp_sise: unknown key \(did you mean"):
        init_inference(_gpt(), tensor_parallel={"tp_sise": 2})
    with pytest.raises(RuntimeError, match="init_distributed"):  # no process group here
        init_inference(_gpt(), tensor_parallel=2)
    with pytest.raises(ValueError, match=r"^tensor_parallel.tp_size: must be an int >= 1"):
        TPConfig.from_section({"tp_size": 0})
    assert TPConfig.from_section({"enabled": False, "tp_size": 4}).tp_size == 1


def test_llama_kv_heads_that_tp_does_not_divide_are_named():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=41, hidden_size=32, intermediate_size=44, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=24,
    ))  # fmt: skip
    with pytest.raises(ValueError, match=r"kv heads \(num_key_value_heads\) \(1\)"):
        init_inference(llama, tensor_parallel={"tp_size": 2})
