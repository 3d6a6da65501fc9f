"""Consolidation: one fp32 state_dict from a sharded checkpoint, written streaming."""

from __future__ import annotations

import shutil

import pytest
import torch
from ckpt_testlib import build, model_state, train
from zero_testlib import make_model

from minispeed.core.testing import run_distributed
from minispeed.zero.checkpoints import CheckpointError, consolidate, save_checkpoint


def _save_body(rank: int, world_size: int, path: str):
    model, opt = build(stage=2, extras=True)
    train(model, opt, rank, world_size, range(0, 2))
    save_checkpoint(opt, model, path)
    return model_state(model)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("consolidate")
    states = run_distributed(_save_body, world_size=2, args=(str(path / "ckpt"),), timeout_s=120)
    return path, states[0]


def _live_peak_bytes(fn):
    """(fn(), most CPU-allocator bytes alive at once while fn ran), via the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return result, peak


def test_consolidated_file_is_the_model_state_dict(saved):
    path, expected = saved
    report = consolidate(path / "ckpt", path / "model.pt")
    state = torch.load(path / "model.pt", weights_only=True)
    assert list(state) == list(expected)  # every key, in state_dict() order, alias included
    for k, v in expected.items():
        torch.testing.assert_close(state[k].float(), v, rtol=0, atol=0, msg=k)
    assert state["tokens_seen"].dtype == torch.int64
    assert state["lm_head.weight"].data_ptr() == state["wte.weight"].data_ptr()  # still tied
    assert state["wte.weight"].dtype == torch.float32

    fresh = make_model(7)
    fresh.lm_head = torch.nn.Linear(24, 67, bias=False)
    fresh.lm_head.weight = fresh.wte.weight
    fresh.register_buffer("tokens_seen", torch.tensor(0))
    fresh.load_state_dict(state, strict=True)
    assert report.num_params == sum(p.numel() for p in fresh.parameters())


def test_consolidation_memory_stays_below_largest_param_plus_one_shard(saved):
    path, _ = saved
    report, allocator_peak = _live_peak_bytes(lambda: consolidate(path / "ckpt", path / "m.pt"))
    params_bytes = 4 * report.num_params
    # The bound is meaningful: holding the whole model (what torch.save needs) would exceed it.
    assert report.bound_bytes < params_bytes
    assert report.peak_held_bytes <= report.bound_bytes
    print(
        f"consolidation: peak held {report.peak_held_bytes} B, allocator peak {allocator_peak} B, "
        f"bound {report.bound_bytes} B, model {params_bytes} B"
    )
    assert allocator_peak <= report.bound_bytes


def test_command_line_consolidates_and_reports_failures(saved, capsys):
    from minispeed.zero.__main__ import main

    path, expected = saved
    out = path / "made" / "here" / "cli.pt"  # a missing folder is created, as mkdir -p
    assert main(["consolidate", str(path / "ckpt"), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    torch.testing.assert_close(state["wte.weight"], expected["wte.weight"], rtol=0, atol=0)
    assert "held at most" in capsys.readouterr().out
    assert main(["consolidate", str(path / "ckpt"), str(path / "x.pt"), "--tag", "nope"]) == 1
    assert "does not exist" in capsys.readouterr().out


def test_weights_are_read_without_the_moments_and_missing_weights_are_named(saved, tmp_path):
    path, expected = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(path / "ckpt", copy)
    tag = copy / (copy / "latest").read_text().strip()
    for f in tag.glob("optim.*"):
        f.unlink()  # the optimizer moments are not needed for the weights
    consolidate(copy, tmp_path / "w.pt")
    state = torch.load(tmp_path / "w.pt", weights_only=True)
    torch.testing.assert_close(
        state["blocks.1.mlp.0.weight"], expected["blocks.1.mlp.0.weight"], rtol=0, atol=0
    )
    (tag / "weights.rank00001-of-00002.pt").unlink()
    with pytest.raises(CheckpointError, match=r"weights\.rank00001-of-00002\.pt"):
        consolidate(copy, tmp_path / "w2.pt")
