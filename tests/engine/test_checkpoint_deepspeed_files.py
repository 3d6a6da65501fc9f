"""Checkpoints DeepSpeed 0.19.8 wrote, loaded by minispeed's engine: training goes on as DeepSpeed's.

The fixtures `tests/engine/fixtures/ds_checkpoint_<precision>_stage<s>/` are DeepSpeed's own
files (`scripts/record_ds_checkpoint_files.py`: 3 steps on 2 ranks, `save_checkpoint`, then 2
more steps, whose losses `ds_checkpoint_files.json` keeps). Here a fresh minispeed engine built
by the same script (its import lines changed) loads each directory and trains those 2 steps:
the losses, the evaluation loss at the checkpoint, the learning rate, the counters and the
client state must be DeepSpeed's (floats within 1e-5 relative, as the other ds_* fixtures).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed

FIXTURES = Path(__file__).resolve().parent / "fixtures"
IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n": (
        "from minispeed.engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint\n"
    ),
}


def _fixture() -> dict:
    return json.loads((FIXTURES / "ds_checkpoint_files.json").read_text())


def _script():
    return ds_scripts.load("record_ds_checkpoint_files.py", IMPORTS)


def _resume_every_case(rank, world_size):
    script = _script()
    out = {}
    for precision, stage in script.CASES:
        engine = script.build(precision, stage)
        path, client = engine.load_checkpoint(str(script.case_dir(precision, stage)))
        out[f"{precision} stage {stage}"] = {
            "path": Path(path).parent.name,
            "eval": script.evaluate(engine),
            "lr": engine.get_lr(),
            "counters": script.counters(engine),
            "client": {k: client[k] for k in ("epoch", "note")},
            "client_keys": sorted(client),
            "after": script.train(engine, [rank], script.SAVED_AT, script.MORE),
        }
        engine.destroy()
    # Another ZeRO stage than the one that wrote it: DeepSpeed's stage-2 files into stage 3.
    engine = script.build("fp32", 3)
    engine.load_checkpoint(str(script.case_dir("fp32", 2)))
    out["fp32 stage 2 into stage 3"] = script.train(engine, [rank], script.SAVED_AT, script.MORE)
    engine.destroy()
    return out


def test_fixtures_were_recorded_on_deepspeed_0_19_8():
    assert _fixture()["deepspeed"] == "0.19.8"


def test_deepspeed_checkpoints_resume_with_deepspeeds_losses():
    """Every stage 0-3, fp32, bf16 and fp16: the 2 steps after loading DeepSpeed's files equal
    DeepSpeed's own 2 steps after its save (and after its own load); also DeepSpeed's stage-2
    files loaded into a stage-3 engine."""
    runs = run_distributed(_resume_every_case, world_size=2, timeout_s=300)
    for ours, ref in zip(runs, _fixture()["ranks"], strict=True):
        across = ours.pop("fp32 stage 2 into stage 3")
        ds_scripts.assert_matches(across, ref["fp32 stage 2"]["after"], path="2 into 3")
        for case, got in ours.items():
            want = ref[case]
            assert got["path"] == "global_step3", case
            expect = {k: want[k] for k in ("eval", "lr", "counters", "client", "client_keys")}
            ds_scripts.assert_matches({k: got[k] for k in expect}, expect, path=case)
            ds_scripts.assert_matches(got["after"], want["after"], path=case)
            assert want["resumed_after"] == want["after"]  # DeepSpeed's own resume, the same


def _resume_on_one_rank(rank, world_size):
    """fp32 stage 2 at one rank: each micro-batch both ranks' batches side by side, so the
    gradient is the 2-rank run's (the mean over the same 8 samples)."""
    script = _script()
    engine = script.build("fp32", 2, batch=2 * script.BATCH)
    engine.load_checkpoint(str(script.case_dir("fp32", 2)))
    return {
        "eval": script.evaluate(engine),
        "counters": script.counters(engine),
        "after": script.train(engine, [0, 1], script.SAVED_AT, script.MORE),
    }


def test_a_deepspeed_checkpoint_of_two_ranks_resumes_on_one():
    """Written by 2 data-parallel ranks, loaded on 1: the masters and moments are whole per
    parameter, so the losses are the mean of DeepSpeed's two ranks' losses."""
    (got,) = run_distributed(_resume_on_one_rank, world_size=1, timeout_s=120)
    ref = [r["fp32 stage 2"] for r in _fixture()["ranks"]]
    assert got["counters"] == ref[0]["counters"]
    assert got["eval"] == pytest.approx(ref[0]["eval"], rel=1e-5)
    mean = [(a + b) / 2 for a, b in zip(ref[0]["after"], ref[1]["after"], strict=True)]
    assert got["after"] == pytest.approx(mean, rel=1e-5)


@pytest.mark.parametrize("case", ["fp32_stage1", "fp32_stage3", "bf16_stage2", "bf16_stage3"])
def test_get_fp32_state_dict_reads_a_deepspeed_checkpoint(case):
    """minispeed's `get_fp32_state_dict_from_zero_checkpoint` gives DeepSpeed's: the names,
    shapes and sums DeepSpeed's own function gave for the same directory."""
    from minispeed.engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    precision, stage = case.split("_")
    want = _fixture()["ranks"][0][f"{precision} stage {stage[-1]}"]["fp32"]
    _assert_like_deepspeeds(
        get_fp32_state_dict_from_zero_checkpoint(FIXTURES / f"ds_checkpoint_{case}"), want
    )


def _assert_like_deepspeeds(state: dict, want: dict) -> None:
    """The names (in order), fp32, shapes and sums DeepSpeed's zero_to_fp32 recorded."""
    assert list(state) == list(want)
    for name, t in state.items():
        assert t.dtype == torch.float32 and list(t.shape) == want[name][0], name
        assert float(t.double().sum()) == pytest.approx(want[name][1], rel=1e-6, abs=1e-6), name


def _copy(case: str, to: Path) -> Path:
    shutil.copytree(FIXTURES / f"ds_checkpoint_{case}", to)
    return to


def _second_mp_rank(tag: Path) -> None:
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")


def _rank_gap(tag: Path) -> None:
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt").write_bytes(b"")


def _edit_states(edit):
    def mutate(tag: Path) -> None:
        states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
        edit(states)
        torch.save(states, tag / "mp_rank_00_model_states.pt")

    return mutate


REFUSALS = {
    "tensor parallel": ("fp32_stage2", _second_mp_rank,
                        r"mp_rank_01_model_states.pt: .*tensor- or pipeline"),
    "pipeline": ("fp32_stage2", lambda t: (t / "layer_01-model_states.pt").write_bytes(b""),
                 r"layer_01-model_states.pt: .*pipeline checkpoint"),
    "moe": ("fp32_stage2",
            lambda t: (t / "layer_0_expert_0_mp_rank_00_model_states.pt").write_bytes(b""),
            r"expert_0_mp_rank_00_model_states.pt: .*MoE"),
    "universal": ("fp32_stage2", lambda t: (t / "zero").mkdir(),
                  r"universal checkpoint .* lacks zero/optimizer_state.pt"),
    "a rank's file missing": ("fp32_stage3", _rank_gap,
                              r"lacks the optimizer file of data-parallel rank 1"),
    "the last rank's file missing": (
        "fp32_stage2", lambda t: (t / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(),
        r"written by 2 data-parallel ranks .* ranks 0-0 only"),
    "an object weights_only refuses": (
        "fp32_stage0", _edit_states(lambda s: s.update(note=argparse.Namespace(run="mid-run"))),
        r"mp_rank_00_model_states.pt holds an object .*GLOBAL argparse.Namespace"),
    "no ds_version": ("fp32_stage1", _edit_states(lambda s: s.pop("ds_version")),
                      r"mp_rank_00_model_states.pt has no readable ds_v"),
}  # fmt: skip


@pytest.mark.parametrize("what", list(REFUSALS))
def test_unsupported_deepspeed_checkpoints_are_refused_by_name(tmp_path, what):
    """A pipeline, tensor-parallel or MoE checkpoint, a universal one without its optimizer
    state, a rank's file missing, an object the safe unpickler does not build, no ds_version:
    an error naming the file and what to do, never a KeyError or a wrong load."""
    from minispeed.engine.checkpoint.deepspeed_files import read_tag
    from minispeed.zero.checkpoints import CheckpointError

    case, mutate, message = REFUSALS[what]
    tag = _copy(case, tmp_path / "ckpt") / "global_step3"
    mutate(tag)
    with pytest.raises(CheckpointError, match=message):
        read_tag(tag)


def test_minispeed_consolidate_reads_a_deepspeed_checkpoint(tmp_path):
    """`minispeed consolidate` on DeepSpeed's directories: at stage 3 DeepSpeed's own fp32
    weights; at fp32 stage 0 (which DeepSpeed's zero_to_fp32 cannot read) the module's weights,
    which are the masters there; bf16 at stage 0 is refused by name (masters without names)."""
    from minispeed.engine.cli.main import main

    out = tmp_path / "stage3.pt"
    assert main(["consolidate", str(FIXTURES / "ds_checkpoint_bf16_stage3"), str(out)]) == 0
    want = _fixture()["ranks"][0]["bf16 stage 3"]["fp32"]
    _assert_like_deepspeeds(torch.load(out, weights_only=True), want)

    out = tmp_path / "stage0.pt"
    src = FIXTURES / "ds_checkpoint_fp32_stage0"
    assert main(["consolidate", str(src), str(out)]) == 0
    module = torch.load(src / "global_step3/mp_rank_00_model_states.pt", weights_only=True)[
        "module"
    ]
    state = torch.load(out, weights_only=True)
    assert list(state) == list(module)
    for name, t in module.items():
        torch.testing.assert_close(state[name], t, rtol=0, atol=0)

    assert main(["consolidate", str(FIXTURES / "ds_checkpoint_bf16_stage0"), str(out)]) == 1


def _groups_reordered(rank, world_size):
    import minispeed.engine as deepspeed

    script = _script()
    torch.manual_seed(5)
    model = torch.nn.Sequential(
        torch.nn.Linear(script.IN, script.HIDDEN),
        torch.nn.Tanh(),
        torch.nn.Linear(script.HIDDEN, script.OUT),
    )
    groups = [{"params": list(model[2].parameters())}, {"params": list(model[0].parameters())}]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups, config=script.config("fp32", 0)
    )
    try:
        engine.load_checkpoint(str(script.case_dir("fp32", 0)))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_stage0_optimizer_state_in_other_groups_is_refused():
    """At stage 0 DeepSpeed keeps the optimizer state by position; an optimizer whose groups list
    the parameters in another order is refused naming the parameter, not loaded crosswise."""
    (got,) = run_distributed(_groups_reordered, world_size=1, timeout_s=120)
    assert got.startswith("CheckpointError"), got
    assert "parameter in that place here ('2.weight')" in got and "order that saved it" in got
