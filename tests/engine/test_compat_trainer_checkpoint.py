"""A Trainer resumes, on minispeed, from the checkpoint DeepSpeed's Trainer wrote.

`scripts/record_ds_trainer_checkpoint.py` kept DeepSpeed 0.19.8's `checkpoint-3/` of a Trainer
fine-tune (a tiny `LlamaForCausalLM`, ZeRO-2 and ZeRO-3, `"auto"` ds_config: AdamW and
WarmupDecayLR) under `tests/engine/fixtures/ds_trainer_checkpoint_z<stage>/`. Its `main` runs
here unchanged on minispeed (the `deepspeed` of `packages/deepspeed_compat`, under
`accelerate launch`): a fresh Trainer's `train(resume_from_checkpoint=...)` on a copy of each,
whose logged steps 4-5 (loss, learning rate, gradient norm) must be DeepSpeed's: those of its
uninterrupted run and of its own resume.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

FIXTURE = json.loads(
    (Path(__file__).resolve().parent / "fixtures" / "ds_trainer_checkpoint.json").read_text()
)
LAUNCH = [
    sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
    "--config_file", "scripts/accelerate_deepspeed.yaml",
]  # fmt: skip


def test_fixture_was_recorded_on_deepspeed_0_19_8():
    assert FIXTURE["deepspeed"] == "0.19.8"


def test_trainer_resumes_from_deepspeeds_checkpoint_with_deepspeeds_steps(tmp_path):
    runs = ds_scripts.run_recorder(["record_ds_trainer_checkpoint.py"], tmp_path, launcher=LAUNCH)
    for rank, (mine, ref) in enumerate(zip(runs, FIXTURE["ranks"], strict=True)):
        ours = mine["record_ds_trainer_checkpoint.py"]
        assert ref["resumed"] == ref["uninterrupted"]  # DeepSpeed's own resume
        for stage, steps in ref["uninterrupted"].items():
            assert len(ours[stage]) == len(steps) == 2, (rank, stage)
            for a, b in zip(ours[stage], steps, strict=True):
                assert a.keys() == b.keys(), (rank, stage, a, b)
                for key in a:
                    assert a[key] == pytest.approx(b[key], rel=1e-5), (rank, stage, key, a, b)
