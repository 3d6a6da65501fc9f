"""transformers' Trainer with `tensor_parallel.autotp_size: 2` runs on minispeed, through the
`deepspeed` distribution of packages/deepspeed_compat, as on DeepSpeed 0.19.8.

One torchrun launch (2 processes) runs `scripts/record_ds_autotp.py` unchanged: transformers'
`deepspeed_init` calls `tp_model_init`, accelerate gives both ranks the same batches and
`initialize` cuts a GQA LLaMA (ZeRO-1) and a Qwen2 with q/k/v biases (ZeRO-2) by their
structure (`minispeed.tensor_parallel.auto_plan`), the head gathering whole logits so the
model's own loss trains. Every logged loss, learning rate and gradient norm, `evaluate()`'s loss
and the loss of the model `save_model()` gathered whole (reloaded in a plain process) equal
DeepSpeed's record (`fixtures/ds_autotp.json`) within 2e-4 relative; a Trainer resumed from the
step-3 checkpoint (the engine's tensor-parallel checkpoint) repeats minispeed's own steps 4-6
exactly. DeepSpeed's
record itself equals one process without DeepSpeed (`python scripts/record_ds_autotp.py --plain`:
the same losses to 2e-5).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

AUTOTP = json.loads((Path(__file__).resolve().parent / "fixtures" / "ds_autotp.json").read_text())
REL = 2e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("compat_autotp")
    return [r["record_ds_autotp.py"] for r in ds_scripts.run_recorder(["record_ds_autotp.py"], out)]


@pytest.mark.parametrize("run", ["llama-z1", "qwen2-z2"])
def test_trainer_with_autotp_matches_deepspeed(runs: list[dict], run: str) -> None:
    for rank, (mine, ref) in enumerate(zip(runs, AUTOTP["ranks"], strict=True)):
        ours, theirs = mine[run]["steps"], ref[run]["steps"]
        assert len(ours) == len(theirs), (rank, run, ours, theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert a[key] == pytest.approx(b[key], rel=REL, abs=1e-12), (rank, run, key, a, b)
        assert mine[run]["eval_loss"] == pytest.approx(ref[run]["eval_loss"], rel=REL)
        assert ours[-1]["loss"] < ours[0]["loss"] - 0.2  # it learns
        # the Trainer resumed from the step-3 checkpoint repeats the uninterrupted steps 4-6
        assert mine[run]["resumed_steps"] == ours[-3:], (rank, run)
        if rank == 0:  # save_model() (the split model gathered whole) reloaded in a plain process
            saved = mine[run]["saved_model_eval_loss"]
            assert saved == pytest.approx(ref[run]["saved_model_eval_loss"], rel=REL)
            assert saved == pytest.approx(mine[run]["eval_loss"], rel=1e-5)
