"""The DeepSpeed MoE script (`scripts/record_ds_moe.py`: `MoE(ep_size=2, k=1, drop_tokens=True,
use_rts=False)`, the param-group helper, AdamW, gradients reduced as DeepSpeed's engine does)
run with only its imports changed to `minispeed.engine`, against DeepSpeed 0.19.8's recording
(`fixtures/moe_ep2_top1.json`): the optimizer groups (names, flags, shapes), and per step the
loss, the unscaled l_aux and exp_counts, then an evaluation."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "moe_ep2_top1.json"


def _run_script(rank, world_size):
    return ds_scripts.load("record_ds_moe.py", ds_scripts.MOE_IMPORTS).main()


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_run_script, world_size=2, timeout_s=180)


def test_fixture_was_recorded_on_deepspeed_0_19_8():
    assert json.loads(FIXTURE.read_text())["deepspeed"] == "0.19.8"


def test_param_groups_are_deepspeeds(runs):
    recorded = json.loads(FIXTURE.read_text())["ranks"]
    for got, want in zip(runs, recorded):
        assert got["groups"] == want["groups"]
        assert got["small_groups"] == want["small_groups"]  # max_group_size splits


def test_moe_script_matches_deepspeed_step_by_step(runs):
    recorded = json.loads(FIXTURE.read_text())["ranks"]
    for rank, (got, want) in enumerate(zip(runs, recorded)):
        assert got["exp_counts"] == want["exp_counts"], f"rank {rank}"
        assert got["l_aux"] == pytest.approx(want["l_aux"], abs=1e-5), f"rank {rank}"
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-4), f"rank {rank}"
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-4), f"rank {rank}"
