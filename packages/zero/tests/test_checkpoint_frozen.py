"""Parameters outside the optimizer (frozen ones) are saved and loaded at every stage, including
stage 3, where they are partitioned like the others and must be gathered to be written whole."""

from __future__ import annotations

import torch
from ckpt_testlib import LR, train
from zero_testlib import make_model

import minispeed.zero as zero
from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import load_checkpoint, save_checkpoint


def build_frozen(stage: int, seed: int):
    """TinyGPT with the position embedding frozen (not in the optimizer, requires_grad=False).

    The persistence threshold 0 keeps even small parameters partitioned under stage 3, so the
    frozen one is released there, as a large frozen embedding of a real model would be.
    """
    model = make_model(seed)
    model.wpe.weight.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    config = zero.ZeroConfig(
        stage=stage,
        reduce_bucket_numel=2000,
        allgather_bucket_numel=2000,
        stage3_param_persistence_threshold_numel=0,
    )
    return model, zero.shard(model, torch.optim.AdamW(trained, lr=LR, weight_decay=0.1), config)


def _frozen_value(model) -> torch.Tensor:
    with zero.GatheredParameters([model.wpe.weight]):
        return model.wpe.weight.detach().float().cpu().clone()


def _body(rank: int, world_size: int, path: str) -> dict[int, tuple]:
    out = {}
    for stage in (0, 1, 2, 3):
        where = f"{path}/stage{stage}"
        model, opt = build_frozen(stage, seed=0)
        train(model, opt, rank, world_size, range(0, 1))
        save_checkpoint(opt, model, where)
        uninterrupted = train(model, opt, rank, world_size, range(1, 2))

        model2, opt2 = build_frozen(stage, seed=11)  # other values, the frozen one included
        before = _frozen_value(model2)
        load_checkpoint(opt2, model2, where)
        loaded = _frozen_value(model2)
        resumed = train(model2, opt2, rank, world_size, range(1, 2))
        out[stage] = (before, loaded, uninterrupted, resumed)
    return out


def test_a_frozen_parameter_is_saved_and_loaded_at_every_stage(tmp_path):
    expected = make_model(0).wpe.weight.detach()  # frozen: still its initial value
    for per_stage in run_distributed(_body, world_size=2, args=(str(tmp_path),), timeout_s=120):
        assert sorted(per_stage) == [0, 1, 2, 3]
        for stage, (before, loaded, uninterrupted, resumed) in per_stage.items():
            assert not torch.equal(before, expected), stage  # the fresh model started elsewhere
            torch.testing.assert_close(loaded, expected, rtol=0, atol=0, msg=f"stage {stage}")
            assert resumed == uninterrupted, stage


def _excluded_body(rank: int, world_size: int, path: str) -> dict[int, tuple]:
    """`exclude_frozen`: the tag holds no frozen value; a strict load names the argument, a
    `strict=False` one keeps the loading model's own frozen value and resumes the training."""
    from minispeed.zero.checkpoints import CheckpointError

    out = {}
    for stage in (1, 3):
        where = f"{path}/stage{stage}"
        model, opt = build_frozen(stage, seed=0)
        train(model, opt, rank, world_size, range(0, 1))
        save_checkpoint(opt, model, where, exclude_frozen=True)
        uninterrupted = train(model, opt, rank, world_size, range(1, 2))

        strict_model, strict_opt = build_frozen(stage, seed=0)
        try:
            load_checkpoint(strict_opt, strict_model, where)
            refused = ""
        except CheckpointError as e:
            refused = str(e)
        model2, opt2 = build_frozen(stage, seed=0)  # the frozen value as the saving run built it
        load_checkpoint(opt2, model2, where, strict=False)
        out[stage] = (refused, uninterrupted, train(model2, opt2, rank, world_size, range(1, 2)))
    return out


def test_a_tag_without_the_frozen_parameters_loads_only_when_not_strict(tmp_path):
    runs = run_distributed(_excluded_body, world_size=2, args=(str(tmp_path),), timeout_s=120)
    for per_stage in runs:
        for stage, (refused, uninterrupted, resumed) in per_stage.items():
            assert "exclude_frozen_parameters=True" in refused, (stage, refused)
            assert "'wpe.weight'" in refused and "load_module_strict=False" in refused
            assert resumed == uninterrupted, stage
    for stage in (1, 3):
        tag = next((tmp_path / f"stage{stage}").glob("global_step*"))
        from minispeed.zero.checkpoints import consolidate

        consolidate(tag, tmp_path / f"fp32_{stage}.pt")
        state = torch.load(tmp_path / f"fp32_{stage}.pt", weights_only=True)
        assert "wpe.weight" not in state and "wte.weight" in state
