"""Run `scripts/record_ds_*.py` recorders, unchanged, on the `deepspeed` this venv imports.

In the test venv that `deepspeed` is minispeed's `packages/deepspeed_compat`. Each recorder's
`main(scratch)` runs under another module name (its recording block does not), one after the
other in the same processes (one launch for several checks), and each rank writes
`{script: result}` to `<out>/rank<r>.json`:

    python -m torch.distributed.run --nproc_per_node 2 tests/engine/scripts/run_recorder.py \
        record_ds_trainer.py record_ds_accelerate.py /tmp/out
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ds_scripts

if __name__ == "__main__":
    *scripts, out = sys.argv[1:]
    out = Path(out)
    results = {s: ds_scripts.load(s, {}).main(out / "scratch" / Path(s).stem) for s in scripts}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(results))
    if dist.is_initialized():  # before the interpreter exits: gloo's worker threads still
        dist.barrier()  # holding work then abort the process ("terminate called without an
        dist.destroy_process_group()  # active exception", SIGABRT; seen once in 4 runs)
