"""The table obeys depth and top-k, the JSON carries the tree, and the ds_config section works."""

import json

import pytest
import torch
from torch import nn

from minispeed.profiler import FlopsProfiler, FlopsProfilerConfig, StepProfiler


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8))
    )


def _profile(model):
    with FlopsProfiler(model, peak_flops_per_s=1e12) as prof:
        model(torch.randn(4, 8)).sum().backward()
    return prof.result()


def test_table_limits_depth_and_keeps_the_top_k_children_by_flops():
    r = _profile(_mlp())
    text = r.render(depth=1, top_k=1)
    lines = [ln for ln in text.splitlines() if "Linear" in ln or "Sequential" in ln]
    assert len(lines) == 2  # the root, and its one heaviest child (the inner Sequential)
    assert "Sequential" in lines[1] and "Linear" not in lines[1]
    all_rows = r.render(depth=-1, top_k=-1)
    assert sum("Linear" in ln for ln in all_rows.splitlines()) == 3
    assert "% of peak" in all_rows


def test_json_has_the_tree_the_totals_and_the_peak_fraction():
    r = _profile(_mlp())
    data = json.loads(json.dumps(r.to_json()))
    assert data["forward"]["flops"] == r.forward.flops > 0
    # Backward is measured: dX and dW per layer, except the first layer's dX (its input needs
    # no gradient), which a "backward = 2x forward" rule would count.
    assert data["backward"]["macs"] == 2 * data["forward"]["macs"] - 4 * 8 * 32
    assert data["modules"]["children"][2]["children"][1]["name"] == "2.1"
    assert data["peak_fraction"] == pytest.approx(r.flops_per_s / 1e12)
    assert data["modules"]["params"] == sum(p.numel() for p in _mlp().parameters())


def test_from_section_translates_the_section_and_refuses_unknown_keys():
    cfg = FlopsProfilerConfig.from_section(
        {"enabled": True, "profile_step": 2, "module_depth": 1, "top_modules": 2,
         "detailed": False, "output_file": None}
    )  # fmt: skip
    assert (cfg.enabled, cfg.profile_step, cfg.module_depth, cfg.top_modules) == (True, 2, 1, 2)
    with pytest.raises(
        ValueError, match=r"flops_profiler.enable: unknown key .did you mean .enabled"
    ):
        FlopsProfilerConfig.from_section({"enable": True})
    with pytest.raises(ValueError, match="recompute_fwd_factor"):
        FlopsProfilerConfig.from_section({"recompute_fwd_factor": 1.0})
    # DeepSpeed's default changes nothing: a config written out in full loads.
    assert FlopsProfilerConfig.from_section({"recompute_fwd_factor": 0.0}) == FlopsProfilerConfig()
    with pytest.raises(ValueError, match="top_modules"):
        FlopsProfilerConfig(top_modules=0)


def test_step_profiler_profiles_only_the_configured_step_and_writes_json(tmp_path):
    model = _mlp()
    out = tmp_path / "profile.json"
    steps = StepProfiler(
        model, FlopsProfilerConfig(enabled=True, profile_step=1, output_file=str(out))
    )
    for step in range(3):
        with steps.step(step):
            model(torch.randn(4, 8)).sum().backward()
        assert out.exists() == (step >= 1)
    assert json.loads(out.read_text())["modules"]["calls"] == 1


def test_a_profiled_step_counts_the_models_forward_not_the_loops_own_work(tmp_path):
    """Note [the model's forward and backward]: the optimizer's step and the caller's loss run
    in forward, outside the model; the step's forward total is the model's (DeepSpeed's engine
    profile), its backward the model's. A plain `FlopsProfiler` keeps counting them."""
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    out = str(tmp_path / "profile.json")
    steps = StepProfiler(model, FlopsProfilerConfig(enabled=True, profile_step=0, output_file=out))
    x = torch.randn(4, 8)
    with steps.step(0):
        model(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    r = steps.profile
    assert r.outside_forward.flops == 0 and r.forward == r.root.forward
    assert r.outside_backward.flops == 0 and r.backward == r.root.backward
    model.zero_grad()  # no .grad to add into: the same backward as the step's
    alone = _profile(model)  # forward and backward only
    assert r.forward == alone.root.forward and r.backward == alone.root.backward
    with FlopsProfiler(model) as prof:
        model(x).sum().backward()
        opt.step()
    assert prof.result().outside_forward.flops > alone.outside_forward.flops  # + the step's


def test_the_peak_can_be_the_calibrated_one_and_a_bad_peak_is_refused(tmp_path, monkeypatch):
    from minispeed.profiler import perf_model

    monkeypatch.setattr(perf_model, "CALIBRATION_FILE", tmp_path / "calibration.json")
    model = _mlp()
    with pytest.raises(FileNotFoundError, match=r"minispeed\.profiler calibrate"):
        FlopsProfiler(model, peak_flops_per_s="calibrated")
    machine = perf_model.Machine({128: 2e9, 256: 5e9})
    (tmp_path / "calibration.json").write_text(json.dumps(machine.to_json()))
    with FlopsProfiler(model, peak_flops_per_s="calibrated") as prof:
        model(torch.randn(4, 8)).sum().backward()
    r = prof.result()
    assert r.peak_flops_per_s == 5e9 and r.peak_fraction == pytest.approx(r.flops_per_s / 5e9)
    with pytest.raises(ValueError, match="positive FLOP/s"):
        FlopsProfiler(model, peak_flops_per_s=0)


def test_the_table_shows_the_work_outside_the_model_so_rows_add_up():
    model = _mlp()
    r = _profile(model)  # the test's .sum() and its backward run outside the model
    assert r.outside_forward.flops > 0
    row = next(ln for ln in r.render().splitlines() if "(outside modules)" in ln)
    assert f"{100 * (r.outside_forward.flops + r.outside_backward.flops) / r.flops:.1f}" in row
    assert r.root.flops + r.outside_forward.flops + r.outside_backward.flops == r.flops
