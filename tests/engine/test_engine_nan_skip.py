"""A NaN in one rank's gradients at one step: skipped as DeepSpeed 0.19.8 skips it.

`scripts/record_ds_nan_skip.py` (2 ranks, 4 steps, rank 1's loss times NaN at step 2; ZeRO 0-3
in fp32 and bf16, and bf16 at stage 2 with `bf16.check_grad_overflow: false`) runs here with its
import line changed to minispeed's, and every rank's record must equal DeepSpeed's
(`tests/engine/fixtures/ds_nan_skip.json`): where DeepSpeed skips (fp32 at stages 1-3, bf16 at
every stage by default) the step is not applied, `skipped_steps` is 1, the norm is infinite, the
learning rate does not move, and the parameters after the last step are DeepSpeed's; where it
does not (fp32 at stage 0, bf16 with the check off at stage 2) the NaN reaches every weight in
both. Numbers of bf16 runs are compared to 1e-2 (bf16's rounding: DeepSpeed's stage-0 bf16 keeps
bf16 gradients), the rest to 1e-5; flags, counts and NaN exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_nan_skip.json"


def _nan_skip(rank, world_size):
    return ds_scripts.load("record_ds_nan_skip.py", ds_scripts.PLAIN_IMPORTS).main()


def test_nan_in_one_rank_skips_the_step_as_deepspeed():
    fixture = json.loads(FIXTURE.read_text())
    assert fixture["deepspeed"] == "0.19.8"
    runs = run_distributed(_nan_skip, world_size=2, timeout_s=240)
    for ours, ref in zip(runs, fixture["ranks"], strict=True):
        for case_ours, case_ref in zip(ours, ref, strict=True):
            rel = 1e-2 if case_ref["case"][1] == "bf16" else 1e-5
            ds_scripts.assert_matches(case_ours, case_ref, rel, str(case_ref["case"]))
