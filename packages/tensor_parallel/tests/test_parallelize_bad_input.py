"""A plan that cannot apply is refused on every rank, before any module changes and before any
collective, with an error naming the problem and the fix: a pattern matching no module, a module
matched twice, a layer split twice, a tied embedding split differently from its head, a size
that does not divide the heads, kv heads, MLP width or vocabulary."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import minispeed.tensor_parallel as tp
from minispeed.core.testing import run_distributed

pytestmark = pytest.mark.timeout(300)


class Tied(nn.Module):
    """An embedding and an output head sharing one weight, and an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)
        self.fc = nn.Linear(4, 8)
        self.proj = nn.Linear(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


GOOD = {"emb": tp.Vocab(), "fc": tp.Column(), "proj": tp.Row(), "head": tp.Column()}
BAD_PLANS = {
    "missing": (
        {**GOOD, "projj": tp.Row()},
        r"'projj' matches no module; closest paths: \['proj'\]",
    ),
    "matched twice": ({**GOOD, "p*": tp.Row()}, r"'proj' is matched by both 'proj' and 'p\*'"),
    "tied not split": (
        {k: v for k, v in GOOD.items() if k != "head"},
        r"tied weight is shared by \['emb', 'head'\] but split differently.*'head' not split",
    ),
    "tied split differently": ({**GOOD, "head": tp.Row()}, r"'head' as Row"),
    "wrong module type": (
        {**GOOD, "proj": tp.Vocab()},
        r"'proj' \(matched by 'proj'\): vocabulary parallelism takes an nn.Embedding, not Linear",
    ),
    "heads attribute": (
        {**GOOD, "proj": tp.Heads(("n_head",))},
        r"'proj' \(matched by 'proj'\): Heads divides the integer attribute 'n_head' by 2, but it is None",
    ),
}


def _body(rank: int, world_size: int) -> dict:
    errors = {}
    for name, (styles, _) in BAD_PLANS.items():
        model = Tied()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            tp.parallelize(model, tp.Plan(styles), None)
        except ValueError as err:
            errors[name] = str(err)
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            assert isinstance(model.fc, nn.Linear)  # refused before anything changed
    model = tp.parallelize(Tied(), tp.Plan(GOOD), None)
    assert model.head.weight is model.emb.weight  # the tie survives: one slice, shared
    assert model.emb.weight.shape == (4, 4)
    try:
        tp.parallelize(model, tp.Plan(GOOD), None)
    except ValueError as err:
        errors["twice"] = str(err)
    try:
        tp.parallelize(Tied(), tp.Plan(GOOD, {"heads (n_head)": 3}), None)
    except ValueError as err:
        errors["heads"] = str(err)
    return errors


def test_bad_plans_raise_on_every_rank_and_leave_the_model_whole():
    results = run_distributed(_body, world_size=2)
    for errors in results:
        for name, (_, pattern) in BAD_PLANS.items():
            assert name in errors, f"{name}: not refused"
            assert re.search(pattern, errors[name]), errors[name]
        assert "module 'emb' is already tensor-parallel" in errors["twice"]
        assert "applied twice" in errors["twice"]
        assert (
            "tensor-parallel size=2 does not divide the model's heads (n_head) (3)"
            in errors["heads"]
        )


def test_ready_plans_name_the_count_the_size_does_not_divide():
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=44, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=16,
    ))  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"size=2 does not divide the model's kv heads \(num_key_value_heads\) \(1\)",
    ):
        tp.check_divides(2, tp.llama_plan(llama).divides)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_embd=32, n_head=4, n_layer=1)
    )
    with pytest.raises(
        ValueError, match=r"vocabulary \(vocab_size\) \(50\).*pick a size among \[1, 2\]"
    ):
        tp.check_divides(4, tp.gpt2_plan(gpt2).divides)
    with pytest.raises(ValueError, match="sequence parallelism is not offered for Hugging Face"):
        tp.gpt2_plan(gpt2, sequence_parallel=True)
