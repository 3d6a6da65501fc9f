"""Ulysses for Hugging Face models (`alst.py`) on 2 gloo ranks: a LLaMA with its sdpa attention
registered as `UlyssesAttention`, fed by `SequenceShardLoader` (each rank reading batches of its
own length, the two lengths unequal, labels masked over a prompt) and averaged by
`sequence_parallel_mean`, gives per micro-step the loss and every gradient (averaged over the
group) of the plain model on the whole sequence in one process; with grouped-query attention
and with fewer key/value heads than ranks. Bad head counts, lengths and loaders are refused by
name on every rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import minispeed.comm as comm
import minispeed.tensor_parallel as tp
from minispeed.core.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

VOCAB = 48


def _model(kv_heads: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
        use_cache=False, tie_word_embeddings=False, pad_token_id=None,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg)


def _rows(rank: int) -> list[dict]:
    """Rank r's two batches: lengths 12 and 8 on rank 0, 8 and 16 on rank 1 (unequal at each
    step); the second batch's first 5 labels masked (a prompt)."""
    g = torch.Generator().manual_seed(7 + rank)
    out = []
    for i, t in enumerate([(12, 8), (8, 16)][rank]):
        ids = torch.randint(0, VOCAB, (1, t), generator=g)
        labels = ids.clone()
        if i == 1:
            labels[:, :5] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _sp_body(rank: int, world_size: int, kv_heads: int) -> list[dict]:
    model = _model(kv_heads)
    tp.register_ulysses_attention("sdpa", None, model.config)
    try:
        steps = []
        for batch in tp.SequenceShardLoader(_rows(rank), None):
            model.zero_grad()
            labels = batch["shift_labels"]
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
            loss = model.loss_function(
                logits=out.logits, labels=None, shift_labels=labels, vocab_size=VOCAB
            )
            loss = tp.sequence_parallel_mean(loss, (labels != -100).sum(), None)
            loss.backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            comm.all_reduce(grads)  # the engine's average over the sequence-parallel group
            steps.append({"loss": loss.item(), "grads": grads / world_size})
        return steps
    finally:
        tp.unregister_ulysses_attention("sdpa")


def _whole(kv_heads: int) -> list[dict]:
    """The plain model on each whole sequence, in the order the loader yields them (rank 0's
    first batch, rank 1's first, rank 0's second, rank 1's second)."""
    model = _model(kv_heads)
    steps = []
    for i in range(2):
        for rank in range(2):
            batch = _rows(rank)[i]
            model.zero_grad()
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            loss.backward()
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            steps.append({"loss": loss.item(), "grads": grads})
    return steps


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_ulysses_llama_equals_the_whole_sequence(kv_heads: int) -> None:
    want = _whole(kv_heads)
    for rank, got in enumerate(run_distributed(_sp_body, 2, args=(kv_heads,))):
        assert len(got) == len(want) == 4, rank
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), (rank, i)
            torch.testing.assert_close(g["grads"], w["grads"], rtol=1e-4, atol=1e-6)


def _bad_heads_body(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError, match="divides 3") as err:
        three = SimpleNamespace(num_attention_heads=3, num_key_value_heads=3)
        tp.register_ulysses_attention("sdpa", None, three)
    return str(err.value)


def _uneven_loader_body(rank: int, world_size: int) -> str:
    rows = _rows(rank)[: 1 + rank]  # rank 0 has one batch, rank 1 two
    with pytest.raises(RuntimeError, match=r"ranks \[0\] ended") as err:
        list(tp.SequenceShardLoader(rows, None))
    return str(err.value)


def test_bad_heads_and_unequal_loaders_fail_on_every_rank() -> None:
    assert all(run_distributed(_bad_heads_body, 2))
    assert all(run_distributed(_uneven_loader_body, 2))


def test_shard_batch_refuses_what_it_cannot_cut() -> None:
    ids = torch.zeros(1, 9, dtype=torch.long)
    with pytest.raises(ValueError, match="pad_to_multiple_of=2"):
        tp.shard_batch({"input_ids": ids}, 0, 2)
    with pytest.raises(ValueError, match=r"batch\['mask'\]"):
        tp.shard_batch({"input_ids": ids[:, :8], "mask": torch.zeros(8)}, 0, 2)
    with pytest.raises(ValueError, match="'input_ids' of shape"):
        tp.shard_batch({"labels": ids}, 0, 2)
    with pytest.raises(ValueError, match="needs a 4-D mask"):
        tp.register_ulysses_attention("eager", None, _model(2).config)


def test_shard_batch_shifts_labels_before_cutting() -> None:
    """The last token of rank 0's half keeps its target, the first label of rank 1's half."""
    ids = torch.arange(8).view(1, 8)
    halves = [tp.shard_batch({"input_ids": ids, "labels": ids + 100}, r, 2) for r in range(2)]
    assert halves[0]["shift_labels"].tolist() == [[101, 102, 103, 104]]
    assert halves[1]["shift_labels"].tolist() == [[105, 106, 107, -100]]
    assert halves[1]["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert "labels" not in halves[0]
