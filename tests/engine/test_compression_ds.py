"""DeepSpeed's compression library, step for step: `scripts/record_ds_compression.py` runs here
with its import lines changed to minispeed's, and every rank's record must equal DeepSpeed's
(`tests/engine/fixtures/ds_compression.json`, DeepSpeed 0.17.6: 0.19.8 removed the library).

Per case, on 2 gloo ranks through the engine: the outputs after `init_compression`, the loss of
each of 6 steps across the techniques' `schedule_offset`s (weight quantization symmetric 8/4
bits in 2 groups (the embedding per token row) from step 2 with static 8-bit activations from
step 3; asymmetric 4-bit weights and an 8-bit embedding from step 0 with dynamic activations
from step 1; l1 sparse + l1 row pruning with
`related_modules` + topk head pruning with Q/K/V related; topk sparse + topk row pruning in
place; topk channel pruning of a convolution with its batch norm and next convolution related),
the outputs after training, every parameter's shape after `redundancy_clean` (rows and
heads removed where DeepSpeed removes them) and the outputs after it; and a 2-layer student
initialized from teacher layers [1, 3]. The topk scores are DeepSpeed's random draws, given
back to the script. Numbers to 1e-5 relative.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_compression.json"
IMPORTS = {
    "import deepspeed\n": "import minispeed.engine as deepspeed\n",
    "from deepspeed.compression.compress import init_compression, redundancy_clean\n": (
        "from minispeed.engine.compression.compress import init_compression, redundancy_clean\n"
    ),
}


def _compression(rank, world_size, scores):
    return ds_scripts.load("record_ds_compression.py", IMPORTS).main(scores[rank])


def test_compression_training_matches_deepspeed():
    fixture = json.loads(FIXTURE.read_text())
    assert fixture["deepspeed"] == "0.17.6"
    scores = [{r["case"]: r["scores"] for r in rank if "scores" in r} for rank in fixture["ranks"]]
    runs = run_distributed(_compression, world_size=2, args=(scores,), timeout_s=240)
    for ours, ref in zip(runs, fixture["ranks"], strict=True):
        for case_ours, case_ref in zip(ours, ref, strict=True):
            case_ref = {k: v for k, v in case_ref.items() if k != "scores"}
            ds_scripts.assert_matches(case_ours, case_ref, 1e-5, case_ref["case"])
