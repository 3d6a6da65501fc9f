"""Records DeepSpeed 0.19.8's batch triple for the cases in `test_config_batch_triple.py`.

Run with the reference venv, without minispeed on the path:
`env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python ds_reference_batch_triple.py`;
prints `[config, data-parallel size, [train, micro, accumulation] or "error"]` per case. The data-
parallel size reaches `DeepSpeedConfig` through an `mpu` (as DeepSpeed's pipeline engine passes
its grid).
"""

import json
import sys
import tempfile
from pathlib import Path

import deepspeed.runtime.config as dsc
import torch.distributed as tdist

T, MB, GA = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"
CASES = [
    ({T: 32, MB: 4}, 1),
    ({T: 32, MB: 4}, 2),
    ({T: 32, GA: 4}, 2),
    ({MB: 2, GA: 4}, 3),
    ({T: 24}, 3),
    ({MB: 5}, 2),
    ({T: 48, MB: 3, GA: 8}, 2),
    ({T: 30, MB: 4}, 1),
    ({T: 32, MB: 4, GA: 2}, 2),
    ({T: 2, MB: 4}, 1),
    ({GA: 4}, 1),
    ({}, 1),
]


class DataParallelOnly:
    """The part of an mpu `DeepSpeedConfig` reads."""

    def __init__(self, n: int) -> None:
        self.n = n

    def get_data_parallel_world_size(self) -> int:
        return self.n


def main() -> None:
    tdist.init_process_group(
        "gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1
    )
    dsc.dist.get_rank = lambda *a, **k: 0  # no deepspeed.comm group: the rank is all it reads
    out = []
    for cfg, n in CASES:
        try:
            c = dsc.DeepSpeedConfig(dict(cfg), mpu=DataParallelOnly(n))
            res = [
                c.train_batch_size,
                c.train_micro_batch_size_per_gpu,
                c.gradient_accumulation_steps,
            ]
        except (AssertionError, ValueError):
            res = "error"
        out.append([cfg, n, res])
    print(json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
    from ds_fixture import require_deepspeed

    require_deepspeed()  # refuses minispeed under DeepSpeed's name
    main()
