"""Bad input fails on every rank with an error naming the fix, never a hang."""

import pytest
import torch
from pipeline_testlib import VOCAB, data, lm_loss, tiny_gpt

import minispeed.pipeline as pp
from minispeed.core.testing import run_distributed


def _train_then(rank, world_size, what):
    module = pp.partition(
        tiny_gpt(world_size), stages=world_size, loss_fn=lm_loss, method="uniform"
    )
    ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.01), micro_batches=4)
    x, y = data(1, 8)[0]
    ex.train_batch(x, y)
    if what == "longer_sequence":  # same batch size, one more token: every activation grows
        x = torch.randint(0, VOCAB, (8, x.shape[1] + 1))
        y = torch.randint(0, VOCAB, (8, y.shape[1] + 1))
    elif what == "indivisible_batch":
        x, y = x[:6], y[:6]
    try:
        ex.train_batch(x, y)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def test_shape_mismatch_between_micro_batches_raises_on_both_ranks():
    results = run_distributed(_train_then, world_size=2, args=("longer_sequence",), timeout_s=60)
    for name, text in results:
        assert name == "PipelineShapeError"
        assert "stage 0 sends activations to stage 1 shaped (float32[2, 5, 8] grad)" in text
        assert "negotiated (float32[2, 4, 8] grad)" in text and "pad or bucket" in text


def test_a_failure_on_one_stage_stops_all_four():
    results = run_distributed(_train_then, world_size=4, args=("longer_sequence",), timeout_s=60)
    assert [r[0] for r in results] == ["PipelineShapeError", "PipelineShapeError",
                                       "PipelineAbortedError", "PipelineAbortedError"]  # fmt: skip
    for _, text in results[2:]:  # the stages that did not fail name the two that did
        assert "stage 0 of data-parallel replica 0 (global rank 0) failed in send" in text
        assert "stage 1 of data-parallel replica 0 (global rank 1) failed in recv" in text


def test_indivisible_batch_raises_on_every_rank():
    results = run_distributed(_train_then, world_size=2, args=("indivisible_batch",), timeout_s=60)
    assert results[0][0] == "ValueError" and "not divisible by micro_batches=4" in results[0][1]
    assert results[1][0] in ("ValueError", "PipelineAbortedError")


def _too_few_micro_batches(rank, world_size):
    module = pp.partition(tiny_gpt(2), stages=world_size, loss_fn=lm_loss, method="uniform")
    with pytest.raises(pp.ScheduleConfigError, match=r"M=1 < P=2"):
        pp.PipelineExecutor(module, None, micro_batches=1, schedule="1f1b")


def test_too_few_micro_batches_for_1f1b_raises_before_training_on_every_rank():
    run_distributed(_too_few_micro_batches, world_size=2, timeout_s=60)


def _partition_errors(rank, world_size):
    with pytest.raises(pp.PartitionError, match="only 3 layers"):
        pp.partition(tiny_gpt(1), stages=world_size, method="uniform", virtual_stages=2)
    with pytest.raises(pp.PartitionError, match="empty"):
        pp.partition(tiny_gpt(2), stages=world_size, method=[0, 0, 4])


def test_more_stages_than_layers_and_empty_stages_raise_on_every_rank():
    run_distributed(_partition_errors, world_size=2, timeout_s=60)


class DictBlock(torch.nn.Module):
    """A Hugging Face habit: a block returning a dict."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        return {"hidden_states": self.proj(x)}


def _dict_output(rank, world_size):
    layers = tiny_gpt(2)
    layers[1] = pp.LayerSpec(DictBlock, (8,))
    module = pp.partition(layers, stages=2, loss_fn=lm_loss, method=[0, 2, 4])
    ex = pp.PipelineExecutor(module, torch.optim.SGD(module.parameters(), lr=0.1), micro_batches=2)
    try:
        ex.train_batch(*data(1, 4)[0])
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def test_a_stage_returning_a_dict_is_named_on_every_rank():
    results = run_distributed(_dict_output, world_size=2, timeout_s=60)
    name, text = results[0]
    assert name == "TypeError"
    assert "pipeline stage 0 (layers 0..1) returned dict" in text
    assert "a tensor or a tuple of tensors" in text
    assert results[1][0] == "PipelineAbortedError" and "stage 0" in results[1][1]
