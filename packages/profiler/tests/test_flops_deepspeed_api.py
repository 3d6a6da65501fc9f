"""DeepSpeed's flops-profiler API on ours: `start_profile` / `stop_profile` / `end_profile`,
`get_total_*`, `print_model_profile` and the one-call `get_model_profile`, checked against the
counts DeepSpeed 0.19.8 itself gave for the same model (`fixtures/deepspeed_flops_profile.json`,
recorded by `fixtures/record_deepspeed_flops.py`). MACs and parameters agree exactly; FLOPs
differ only where we count what DeepSpeed leaves out, listed term by term below."""

import json
from pathlib import Path

import pytest
import torch
from ds_reference_model import INPUT_SHAPE, build
from torch import nn

from minispeed.profiler import FlopsProfiler, get_model_profile

DS = json.loads((Path(__file__).parent / "fixtures" / "deepspeed_flops_profile.json").read_text())
BATCH = INPUT_SHAPE[0]
# Where our FLOPs exceed DeepSpeed's, per module (Differences from DeepSpeed, docs page):
EXTRA = {
    "head.0": BATCH * 32,  # the Linear's bias add (DeepSpeed: 2·MACs only)
    "head.1": BATCH * 32 * (7 - 5),  # LayerNorm: 7 FLOPs per element, DeepSpeed 5
    "head.3": BATCH * 10,  # the Linear's bias add
    "softmax": BATCH * 10 * (5 - 1),  # softmax: 5 per element (max, sub, exp, sum, div), DS 1
}
EXTRA["head"] = EXTRA["head.0"] + EXTRA["head.1"] + EXTRA["head.3"]
EXTRA["model"] = EXTRA["head"] + EXTRA["softmax"]


def test_get_model_profile_agrees_with_deepspeed_where_the_conventions_agree():
    model = build()
    flops, macs, params = get_model_profile(
        model, input_shape=INPUT_SHAPE, print_profile=False, as_string=False
    )
    ref = DS["get_model_profile"]
    assert (macs, params) == (ref["macs"], ref["params"])
    assert flops == ref["flops"] + EXTRA["model"]
    strings = get_model_profile(model, input_shape=INPUT_SHAPE, print_profile=False)
    assert strings[1:] == tuple(DS["get_model_profile_as_string"][1:])  # "61.06 KMACs", "17.03 K"
    assert strings[0] == f"{round(flops / 1e3, 2):g} K"


def test_per_module_counts_agree_with_deepspeed_module_by_module():
    model = build()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.zeros(INPUT_SHAPE))
    prof.stop_profile()
    r = prof.result()
    for name, ref in DS["modules"].items():
        row = r.module(name)
        assert row.forward.macs == ref["macs"], name
        assert row.forward.flops == ref["flops"] + EXTRA.get(name, 0), name
    assert prof.get_total_flops() == r.root.forward.flops
    assert prof.get_total_macs() == DS["get_model_profile"]["macs"]
    assert prof.get_total_params() == DS["get_model_profile"]["params"]
    assert 0 < prof.get_total_duration() < 60
    prof.end_profile()
    assert prof.get_total_flops() == 0


def test_the_lifecycle_refuses_misuse_and_prints_the_profile(tmp_path, capsys):
    model = build()
    prof = FlopsProfiler(model)
    with pytest.raises(RuntimeError, match="not running"):
        prof.stop_profile()
    with pytest.raises(RuntimeError, match="start_profile"):
        prof.print_model_profile()
    prof.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        prof.start_profile()
    model(torch.zeros(INPUT_SHAPE))
    prof.stop_profile()
    prof.print_model_profile(module_depth=1, top_modules=2)
    out = capsys.readouterr().out
    assert "fwd MACs per rank: 61.06 KMACs" in out and "head" in out
    path = tmp_path / "profile.txt"
    prof.print_model_profile(output_file=str(path))
    assert "params per rank: 17.03 K" in path.read_text()
    prof.start_profile()  # a new profile: the old counts are gone, not doubled
    model(torch.zeros(INPUT_SHAPE))
    prof.stop_profile()
    assert prof.get_total_macs() == DS["get_model_profile"]["macs"]


def test_get_model_profile_takes_args_and_kwargs_restores_training_and_refuses_bad_input():
    model = build().train()
    x = torch.zeros(INPUT_SHAPE)
    by_args = get_model_profile(model, args=[x], print_profile=False, as_string=False)
    by_kwargs = get_model_profile(model, kwargs={"x": x}, print_profile=False, as_string=False)
    assert by_args == by_kwargs
    assert model.training  # DeepSpeed leaves the model in eval mode; we restore it
    ignored = get_model_profile(
        model, args=[x], print_profile=False, as_string=False, ignore_modules=[nn.LayerNorm]
    )
    assert ignored == by_args  # the LayerNorm's work is its caller's: the total is the same
    with pytest.raises(ValueError, match="input_shape, or args"):
        get_model_profile(model)
    with pytest.raises(TypeError, match="non-empty tuple"):
        get_model_profile(model, input_shape=[2, 3, 8, 8])
    with pytest.raises(ValueError, match="mode"):
        get_model_profile(model, args=[x], mode="backward")
