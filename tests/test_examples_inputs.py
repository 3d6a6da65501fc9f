"""The example's building blocks refuse bad input with errors that name the fix, and keep their
promises about shapes and determinism (no processes started: these run in milliseconds)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: one thread is fastest, and does not fight the other tests for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _example(name: str):
    """Import ``examples/<name>.py`` (the examples import each other by plain module name)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def test_gpt_param_count_formula_matches_module():
    gpt = _example("gpt")
    cfg = gpt.GPTConfig(vocab_size=53, block_size=32, n_layer=2, n_head=4, n_embd=48)
    model = gpt.GPT(cfg)
    assert model.num_params() == cfg.num_params()
    logits, loss = model(torch.zeros(3, 32, dtype=torch.long), torch.zeros(3, 32, dtype=torch.long))
    assert logits.shape == (3, 32, 53) and loss.ndim == 0


def test_gpt_rejects_bad_shapes():
    gpt = _example("gpt")
    with pytest.raises(ValueError, match="divisible by n_head"):
        gpt.GPTConfig(vocab_size=10, n_embd=50, n_head=4)
    model = gpt.GPT(gpt.GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8))
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_generate_greedy_is_deterministic_and_crops_context():
    gpt = _example("gpt")
    torch.manual_seed(0)
    model = gpt.GPT(
        gpt.GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=8)
    ).eval()
    idx = torch.zeros(2, 3, dtype=torch.long)
    a = model.generate(idx, 12, temperature=0.0)  # runs past block_size: the context is cropped
    b = model.generate(idx, 12, temperature=0.0)
    assert a.shape == (2, 15) and torch.equal(a, b)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(idx, 1, temperature=-1.0)


def test_tokenizer_round_trip_and_unknown_character():
    data = _example("data")
    ds = data.CharDataset.from_file()
    tok = ds.tokenizer
    text = "ZeRO splits the optimizer state."
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("€")


def test_batches_are_rank_shares_of_one_global_batch():
    data = _example("data")
    ds = data.CharDataset.from_file()
    x, y = ds.batch("train", step=3, global_batch=8, block_size=16, seed=5)
    parts = [ds.batch("train", 3, 8, 16, seed=5, rank=r, world_size=2) for r in range(2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    with pytest.raises(ValueError, match="does not divide by world size"):
        ds.batch("train", 0, 7, 16, world_size=2)
