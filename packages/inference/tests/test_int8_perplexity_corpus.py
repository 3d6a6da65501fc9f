"""int8 weight-only quantization keeps a trained model's perplexity: a small GPT trained for a few
seconds on the bundled corpus scores within 2 % of its fp32 perplexity on the held-out split with
≈ 4× fewer weight bytes (the demo-size figure: benchmarks/inference_int8.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from minispeed.inference import init_inference, weight_bytes
from minispeed.inference.evaluation import perplexity

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[3]


def _example(name: str):
    key = f"minispeed_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, REPO / f"examples/{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: a second spinning thread only slows a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained():
    """2 layers, width 32, 16-token context, 100 AdamW steps of 32 windows (~2 s on a quiet core)."""
    gpt, data = _example("gpt"), _example("data")
    ds = data.CharDataset.from_file()
    torch.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=ds.tokenizer.vocab_size, block_size=16, n_layer=2,
                                  n_head=4, n_embd=32))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as one_thread (module fixtures are set up before it)
    try:
        for step in range(100):
            x, y = ds.batch("train", step, 32, 16)
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval(), ds


def test_int8_perplexity_within_2_percent_of_fp32(trained):
    model, ds = trained
    val = ds.splits["val"]
    fp32, _ = init_inference(model)
    int8, _ = init_inference(model, dtype=torch.int8)
    ppl32, ppl8 = perplexity(fp32, val, window=16), perplexity(int8, val, window=16)
    # the model learned more than character frequencies (a uniform guess scores V = 50-odd;
    # unigram frequencies about 19), so the comparison is about a real model
    assert ppl32 < 15, f"fp32 perplexity {ppl32:.2f}: the model did not train"
    assert abs(ppl8 / ppl32 - 1) <= 0.02, f"int8 {ppl8:.3f} vs fp32 {ppl32:.3f}"
    # the eager GPT scores the same as the injected fp32 model (same weights, same math)
    assert perplexity(model, val, window=16) == pytest.approx(ppl32, rel=1e-5)
    # block linears: N·K + 4N bytes against 4·N·K: 4K/(K+4) = 3.56 at K = 32, 3.88 at K = 128
    ratio = weight_bytes(model.blocks) / weight_bytes(int8.blocks)
    want = sum(
        4 * m.weight.numel() for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)
    )
    got = sum(m.weight_q.numel() + 4 * m.scales.numel() for m in int8.blocks.modules()
              if hasattr(m, "weight_q"))  # fmt: skip
    assert (weight_bytes(model.blocks), weight_bytes(int8.blocks)) == (want, got)
    assert 3.5 < ratio < 4


def test_perplexity_counts_each_token_once():
    V = 7

    class Uniform(torch.nn.Module):  # every token has probability 1/V: perplexity exactly V
        def forward(self, x):
            return torch.zeros(*x.shape, V)

    assert perplexity(Uniform(), torch.arange(23) % V, window=5) == pytest.approx(V)

    class Knows(torch.nn.Module):  # puts probability p on the true next token t+1 mod V
        def forward(self, x):
            p = 0.5
            logits = torch.full((*x.shape, V), math.log((1 - p) / (V - 1)))
            return logits.scatter(-1, ((x + 1) % V)[..., None], math.log(p))

    assert perplexity(Knows(), torch.arange(23) % V, window=4, batch_size=2) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(Uniform(), torch.tensor([1]), window=4)
