"""A checkpoint holds each expert once and loads into a different expert-parallel degree."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _models import NUM_EXPERTS, Block, batch, build, config, loss_of

import minispeed.moe as moe
from minispeed.core.testing import run_distributed


def _by_global_id(model) -> dict[str, torch.Tensor]:
    """Every tensor of the model, expert tensors named by global expert id."""
    out = {}
    for layer_name, m in model.named_modules():
        if isinstance(m, moe.Experts):
            for gid, expert in zip(m.global_ids, m.local_experts):
                for n, t in expert.state_dict().items():
                    out[f"{layer_name}.expert{gid}.{n}"] = t.clone()
    prefix = "mlp.experts.local_experts."
    out.update({k: v.clone() for k, v in model.state_dict().items() if not k.startswith(prefix)})
    return out


def _train_and_save(rank: int, world_size: int, ep: int, directory: str) -> dict:
    groups = moe.ExpertGroups(ep)
    model = build(config(ep, drop=True), groups)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss_of(model, *batch(0, rank)).backward()
    moe.reduce_gradients(model, groups)
    opt.step()  # trained weights, not the seeded init, go into the checkpoint
    written = moe.save_checkpoint(model, directory)
    return {"written": [p.name for p in written], "state": _by_global_id(model)}


def _load(rank: int, world_size: int, ep: int, directory: str) -> dict:
    model = build(config(ep, drop=True), moe.ExpertGroups(ep))
    moe.load_checkpoint(model, directory)
    return _by_global_id(model)


def test_save_on_4_ranks_with_replicas_load_on_1_and_on_2(tmp_path: Path):
    # W = 4, E_p = 2: each expert has two replicas (expert-data groups of 2), written once.
    saved = run_distributed(_train_and_save, world_size=4, args=(2, str(tmp_path)))
    written = [name for res in saved for name in res["written"]]
    expert_files = sorted(n for n in written if ".expert" in n)
    assert expert_files == sorted(f"mlp.expert{g}.pt" for g in range(NUM_EXPERTS))
    assert written.count("dense.pt") == 1 and written.count("meta.json") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written)  # no temp files left
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["saved_expert_parallel_degree"] == 2 and meta["layers"] == {"mlp": NUM_EXPERTS}

    truth: dict[str, torch.Tensor] = {}
    for res in saved:
        for k, v in res["state"].items():
            if k in truth:  # replicas and dense copies agree after reduce_gradients
                torch.testing.assert_close(v, truth[k], rtol=0, atol=0)
            truth[k] = v

    one = build(config(1, drop=True))  # all experts on one process
    moe.load_checkpoint(one, tmp_path)
    got = _by_global_id(one)
    assert got.keys() == truth.keys()
    for k in truth:
        assert torch.equal(got[k], truth[k]), k

    for res in run_distributed(_load, world_size=2, args=(2, str(tmp_path))):
        for k, v in res.items():
            assert torch.equal(v, truth[k]), k


def test_load_refuses_an_unfinished_or_mismatched_checkpoint(tmp_path: Path):
    model = build(config(1, drop=True))
    with pytest.raises(FileNotFoundError, match=r"meta\.json is missing"):
        moe.load_checkpoint(model, tmp_path)
    moe.save_checkpoint(model, tmp_path)
    other = moe.replace_mlp(Block(), moe.MoEConfig(num_experts=2, random_token_selection=False))
    with pytest.raises(ValueError, match="build the model with the same layers and num_experts"):
        moe.load_checkpoint(other, tmp_path)


def test_a_bare_moe_layer_round_trips(tmp_path: Path):
    torch.manual_seed(0)
    cfg = moe.MoEConfig(num_experts=2)
    layer = moe.MoE(4, torch.nn.Linear(4, 4), cfg)
    moe.save_checkpoint(layer, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dense.pt", "meta.json", "root.expert0.pt", "root.expert1.pt"
    ]  # fmt: skip
    dense = torch.load(tmp_path / "dense.pt", weights_only=True)
    assert sorted(dense) == ["gate.wg.weight"]  # experts are only in their own files
    torch.manual_seed(1)
    other = moe.MoE(4, torch.nn.Linear(4, 4), cfg)
    moe.load_checkpoint(other, tmp_path)
    for (n, a), (_, b) in zip(layer.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
