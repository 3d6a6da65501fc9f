"""Bad checkpoints get errors that name the problem and the fix, on every rank, without a hang."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from ckpt_testlib import build, train

import minispeed.comm as comm
from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import (
    CheckpointError,
    consolidate,
    load_checkpoint,
    save_checkpoint,
)


def _downgrade(ckpt: Path, dst: Path) -> None:
    """A copy of ``ckpt`` whose metadata claims format version 0."""
    shutil.copytree(ckpt, dst)
    meta_path = dst / "global_step1" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["format_version"] = 0
    meta_path.write_text(json.dumps(meta))


def _errors_body(rank: int, world_size: int, path: str) -> dict[str, str]:
    model, opt = build(stage=2)
    train(model, opt, rank, world_size, range(0, 1))
    save_checkpoint(opt, model, path + "/ckpt")
    if rank == 0:
        _downgrade(Path(path) / "ckpt", Path(path) / "old")
    comm.barrier()
    cases = {
        "shape": lambda: build(stage=2, vocab=68),  # wte.weight is (68, 24), saved (67, 24)
        "missing": lambda: build(stage=1, layers=3),  # blocks.2.* are not in the checkpoint
        "extra": lambda: build(stage=2, layers=1),  # blocks.1.* are not in the model
    }
    messages = {}
    for case, make in cases.items():
        model2, opt2 = make()
        try:
            load_checkpoint(opt2, model2, path + "/ckpt")
        except CheckpointError as e:
            messages[case] = str(e)
    model3, opt3 = build(stage=2)
    try:
        load_checkpoint(opt3, model3, path + "/old")
    except CheckpointError as e:
        messages["version"] = str(e)
    return messages


@pytest.fixture(scope="module")
def messages(tmp_path_factory):
    path = tmp_path_factory.mktemp("errors")
    return path, run_distributed(_errors_body, world_size=2, args=(str(path),), timeout_s=120)


def test_a_model_that_does_not_match_names_the_first_mismatching_parameter(messages):
    _, per_rank = messages
    for m in per_rank:
        assert "'wte.weight' has shape (68, 24) in the model but (67, 24)" in m["shape"]
        assert "model parameter 'blocks.2.ln1.weight'" in m["missing"]
        assert "not in the checkpoint" in m["missing"]
        assert "checkpoint parameter 'blocks.1.ln1.weight'" in m["extra"]
        assert "does not exist in the model" in m["extra"]


def test_an_incompatible_format_version_names_the_fix(messages):
    path, per_rank = messages
    for m in per_rank:
        assert "format version 0" in m["version"] and "reads version 1" in m["version"]
        assert "consolidate" in m["version"]
    with pytest.raises(
        CheckpointError, match=r"format version 0.*python -m minispeed.zero consolidate"
    ):
        consolidate(path / "old", path / "out.pt")


def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="neither a checkpoint directory"):
        consolidate(tmp_path, tmp_path / "out.pt")


def _with_optimizer(make_inner):
    import torch
    from ckpt_testlib import make_model

    import minispeed.zero as zero

    model = make_model(0)
    config = zero.ZeroConfig(stage=2, reduce_bucket_numel=2000, allgather_bucket_numel=2000)
    return model, zero.shard(model, make_inner(torch, model.parameters()), config=config)


def _other_optimizer_body(rank: int, world_size: int, path: str) -> list[str]:
    model, opt = build(stage=2)  # AdamW
    train(model, opt, rank, world_size, range(0, 1))
    save_checkpoint(opt, model, path)
    messages = []
    for make in (
        lambda torch, ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda torch, ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True),
    ):
        model2, opt2 = _with_optimizer(make)
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(opt2, model2, path)
        messages.append(str(e.value))
        load_checkpoint(opt2, model2, path, load_optimizer_states=False)  # the weights do load
        train(model2, opt2, rank, world_size, range(1, 2))
    return messages


def test_optimizer_state_of_another_optimizer_is_refused_by_name(tmp_path):
    """SGD's momentum or amsgrad's maximum is not in an AdamW checkpoint: refused on every rank at
    the load, naming both key sets and the fix (the first step failed on `KeyError: 'exp_avg'`
    for Adam after SGD, and SGD silently started its momentum from zero after Adam)."""
    results = run_distributed(
        _other_optimizer_body, world_size=2, args=(str(tmp_path / "ckpt"),), timeout_s=120
    )
    for sgd, amsgrad in results:
        assert "holds the optimizer state ['exp_avg', 'exp_avg_sq'] per element" in sgd, sgd
        assert "this optimizer (SGD) keeps ['momentum_buffer']" in sgd, sgd
        assert "load_optimizer_states=False" in sgd, sgd
        assert "keeps ['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq']" in amsgrad, amsgrad
