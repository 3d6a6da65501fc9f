"""`parallelize` with the ready plans of Hugging Face GPT-2 (`Conv1D` layout, tied head) and LLaMA
(grouped-query attention, split by kv heads): on 2 gloo ranks the loss and every parameter's
gradient (slices gathered back) equal the unsplit model's to 1e-5, and each rank holds 1/2 of
every split weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import minispeed.tensor_parallel as tp
from minispeed.core.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

VOCAB = 48


def _model(name: str, tie: bool = True):
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, tie_word_embeddings=tie,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        use_cache=False, tie_word_embeddings=tie, pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


PLANS = {"gpt2": tp.gpt2_plan, "llama": tp.llama_plan}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, VOCAB, (2, 12), generator=g)
    return idx, torch.randint(0, VOCAB, (2, 12), generator=g)


def _body(rank: int, world_size: int, name: str, tie: bool) -> dict:
    model = _model(name, tie)
    whole = sum(p.numel() for p in model.parameters())
    tp.parallelize(model, PLANS[name](model), None)
    idx, targets = _batch()
    logits = model(input_ids=idx).logits  # (B, T, V/n)
    loss = tp.vocab_parallel_cross_entropy(logits, targets, None)
    loss.backward()
    return {
        "loss": loss.detach(),
        "local_vocab": logits.shape[-1],
        "grads": tp.unshard_module(model, tp.TensorGroup.of(None), grads=True),
        "params": (whole, sum(p.numel() for p in model.parameters())),
    }


@pytest.mark.parametrize(("name", "tie"), [("gpt2", True), ("llama", False), ("llama", True)])
def test_hf_model_split_over_2_ranks_equals_unsplit(name, tie, rel_close):
    results = run_distributed(_body, world_size=2, args=(name, tie), timeout_s=240)
    model = _model(name, tie)
    idx, targets = _batch()
    want = F.cross_entropy(model(input_ids=idx).logits.flatten(0, 1), targets.flatten())
    want.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    for got in results:
        rel_close(got["loss"], want.detach())
        assert got["local_vocab"] == VOCAB // 2
        assert set(got["grads"]) == set(grads)
        for n, g in grads.items():
            rel_close(got["grads"][n], g)
        whole, local = got["params"]
        assert local < whole * 0.6  # norms and the row-parallel biases stay whole
