"""DeepSpeed's pipeline example shape (`scripts/record_ds_pipe_data.py`): `initialize(
training_data=dataset)` with the optimizer from the config, then `train_batch()` with no
iterator, an `eval_batch` between steps, and `set_batch_fn`. Run with only the imports changed,
on 4 gloo processes (2 stages x 2 data-parallel replicas), against DeepSpeed 0.19.8's recording
(`fixtures/pipe_training_data.json`): each rank's per-step losses within 1e-5."""

import json
from pathlib import Path

import ds_scripts
import pytest
import torch

from minispeed.core.testing import run_distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "pipe_training_data.json"
IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.pipe import LayerSpec, PipelineModule\n": (
        "from minispeed.engine.pipe import LayerSpec, PipelineModule\n"
    ),
}


def _run_script(rank, world_size):
    return ds_scripts.load("record_ds_pipe_data.py", IMPORTS).main()


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_run_script, world_size=4, timeout_s=180)


def test_training_data_feeds_train_batch_as_deepspeeds_loader(runs):
    recorded = json.loads(FIXTURE.read_text())
    assert recorded["deepspeed"] == "0.19.8"
    for ours, theirs in zip(runs, recorded["ranks"], strict=True):
        assert ours["stage"] == theirs["stage"]
        assert ours["loader"] == theirs["loader"] == "RepeatingLoader"
        assert ours["global_steps"] == theirs["global_steps"]
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=0, atol=1e-5)
        assert ours["evaluated"] == pytest.approx(theirs["evaluated"], abs=1e-5)
