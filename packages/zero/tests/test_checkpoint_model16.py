"""`save_16bit_model` and `stage3_gather_16bit_weights_on_model_save`: one plain 16-bit
state_dict that loads into a model without minispeed and equals the trained weights in 16 bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ckpt_testlib import LR, train
from zero_testlib import make_model

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import consolidate, save_16bit_model, save_checkpoint


def _build(stage: int, gather_on_save: bool):
    model = make_model(0)
    config = zero.ZeroConfig(
        stage=stage,
        reduce_bucket_numel=2000,
        stage3_param_persistence_threshold_numel=0,  # everything partitioned under stage 3
        stage3_gather_16bit_weights_on_model_save=gather_on_save,
    )
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, zero.shard(model, inner, config, zero.MixedPrecision(torch.bfloat16))


def _body(rank: int, world_size: int, stage: int, gather_on_save: bool, path: str):
    model, opt = _build(stage, gather_on_save)
    train(model, opt, rank, world_size, range(0, 2))
    save_checkpoint(opt, model, path + "/ckpt")
    try:
        save_16bit_model(opt, model, path + "/export", "model.bin")
        refused = None
    except ValueError as e:
        refused = str(e)
    return refused


def _check_file(file: Path, trained: dict[str, torch.Tensor]) -> None:
    state = torch.load(file, weights_only=True)
    plain = make_model(5).to(torch.bfloat16)
    plain.load_state_dict(state, strict=True)  # loads into a plain model, no minispeed
    assert list(state) == list(trained)
    for k, v in trained.items():
        assert state[k].dtype == torch.bfloat16, k
        torch.testing.assert_close(state[k], v.to(torch.bfloat16), rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("stage", [2, 3])
def test_the_16bit_model_equals_the_trained_weights_in_16_bits(tmp_path, stage):
    refused = run_distributed(_body, world_size=2, args=(stage, True, str(tmp_path)), timeout_s=120)
    assert refused == [None, None]
    consolidate(tmp_path / "ckpt", tmp_path / "fp32.pt")
    trained = torch.load(tmp_path / "fp32.pt", weights_only=True)  # the fp32 masters
    _check_file(tmp_path / "export" / "model.bin", trained)
    _check_file(tmp_path / "ckpt" / "global_step2" / "pytorch_model.bin", trained)


def test_stage3_without_the_key_refuses_to_gather_and_saves_no_16bit_model(tmp_path):
    refused = run_distributed(_body, world_size=2, args=(3, False, str(tmp_path)), timeout_s=120)
    for message in refused:
        assert "stage3_gather_16bit_weights_on_model_save" in message
    assert not (tmp_path / "ckpt" / "global_step2" / "pytorch_model.bin").exists()
    assert not (tmp_path / "export").exists()
