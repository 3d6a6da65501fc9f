"""The two-stage DeepSpeed pipeline script (`scripts/record_ds_pipe.py`: tied embedding/head,
LayerSpec blocks, seed_layers, AdamW, clipping, train_batch with a data iterator, eval_batch)
run with only its imports changed to `minispeed.engine`, against DeepSpeed 0.19.8's recording
(`fixtures/pipe_two_stage.json`): per-step losses and evaluations within 1e-4, the same stage
cut, the same numbers drawn from the global RNG after the build, the logits of `return_logits`."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "pipe_two_stage.json"


def _run_script(rank, world_size):
    return ds_scripts.load("record_ds_pipe.py", ds_scripts.PIPE_IMPORTS).main()


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_run_script, world_size=2, timeout_s=180)


def test_fixture_was_recorded_on_deepspeed_0_19_8():
    assert json.loads(FIXTURE.read_text())["deepspeed"] == "0.19.8"


def test_pipeline_script_matches_deepspeed_step_by_step(runs):
    recorded = json.loads(FIXTURE.read_text())["ranks"]
    for rank, (got, want) in enumerate(zip(runs, recorded)):
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-4), f"rank {rank}"
        assert got["eval_before"] == pytest.approx(want["eval_before"], abs=1e-4)
        assert got["eval_after"] == pytest.approx(want["eval_after"], abs=1e-4)
        assert got["global_steps"] == want["global_steps"]


def test_pipeline_script_cuts_stages_and_reports_them_as_deepspeed(runs):
    recorded = json.loads(FIXTURE.read_text())["ranks"]
    for got, want in zip(runs, recorded):
        assert got["parts"] == want["parts"]
        assert (got["first_stage"], got["last_stage"]) == (want["first_stage"], want["last_stage"])
        assert got["logits_shape"] == want["logits_shape"]
        if want["logits_sum"] is not None:
            assert got["logits_sum"] == pytest.approx(want["logits_sum"], rel=1e-4)


def test_seed_layers_leaves_the_global_rng_where_deepspeed_leaves_it(runs):
    recorded = json.loads(FIXTURE.read_text())["ranks"]
    for got, want in zip(runs, recorded):
        assert got["drawn_after_build"] == pytest.approx(want["drawn_after_build"], abs=0)


def _run_unseeded(rank, world_size):
    return ds_scripts.load("record_ds_pipe.py", ds_scripts.PIPE_IMPORTS).unseeded_build()


def test_unseeded_layers_draw_deepspeeds_weights_from_the_global_rng():
    recorded = json.loads(FIXTURE.read_text())["ranks"]
    for got, want in zip(run_distributed(_run_unseeded, world_size=2), recorded):
        want = want["unseeded"]
        assert got["parts"] == want["parts"]  # DeepSpeed's parameter-balanced cut
        assert got["param_sums"] == pytest.approx(want["param_sums"], rel=1e-6)
        assert got["drawn_after_build"] == pytest.approx(want["drawn_after_build"], abs=0)


def test_eval_batch_forms_match_deepspeed(runs):
    """`compute_loss=False` (the model's outputs), `reduce_output=None` (per micro-batch),
    `bcast_loss=False` (the last stage only) and `num_micro_batches`: the same values on the same
    ranks, None where DeepSpeed returns None."""
    recorded = json.loads(FIXTURE.read_text())["ranks"]
    for rank, (got, want) in enumerate(zip(runs, recorded)):
        assert set(got["eval_forms"]) == set(want["eval_forms"])
        for form, value in want["eval_forms"].items():
            shapes, sums = _flat(got["eval_forms"][form])
            assert (shapes, sums) == (_flat(value)[0], pytest.approx(_flat(value)[1], rel=1e-5)), (
                rank,
                form,
            )


def _flat(summary):
    """A recorded eval_batch summary (None, a list of them, or [shape, sum]) as (the shapes,
    the sums) in order."""
    if summary is None:
        return ["None"], []
    if isinstance(summary[1], float):
        return [str(summary[0])], [summary[1]]
    parts = [_flat(s) for s in summary]
    return [x for p in parts for x in p[0]], [x for p in parts for x in p[1]]
