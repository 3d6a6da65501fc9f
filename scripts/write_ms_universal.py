"""minispeed's checkpoints, and their DeepSpeed universal conversions, kept as test fixtures.

For each case of `record_ds_universal.py`'s `MS_CASES`, minispeed's engine trains the regressor
of `record_ds_checkpoint_files.py` (its import line changed to minispeed's, as the tests do) 3
steps on 2 ranks, saves `tests/engine/fixtures/ms_checkpoint_<case>/global_step3` with
`client_state={"epoch": 2, "note": "mid-run"}`, and rank 0 converts it with
`minispeed consolidate ... --to deepspeed-universal` into `global_step3_universal` beside it
(with `latest_universal`). `record_ds_universal.py` then has DeepSpeed resume from that
folder; `tests/engine/test_checkpoint_deepspeed_universal.py` checks minispeed's own resume against
DeepSpeed's losses. Run with minispeed's venv, before the DeepSpeed recorder:

```bash
.venv/bin/python -m torch.distributed.run --nproc_per_node 2 scripts/write_ms_universal.py
```
"""

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/engine"))
import ds_scripts  # noqa: E402

import minispeed.comm as comm  # noqa: E402
import minispeed.engine  # noqa: E402
from minispeed.engine.cli.main import main as minispeed_main  # noqa: E402

MS_CASES = [("fp32", 2), ("bf16", 3)]


def ms_case_dir(precision, stage):
    return ROOT / f"tests/engine/fixtures/ms_checkpoint_{precision}_stage{stage}"


def main():
    minispeed.engine.init_distributed()
    script = ds_scripts.load("record_ds_checkpoint_files.py", ds_scripts.RESUME_IMPORTS)
    for precision, stage in MS_CASES:
        root = ms_case_dir(precision, stage)
        if comm.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        comm.barrier()
        engine = script.build(precision, stage)
        script.train(engine, [comm.get_rank()], 0, script.SAVED_AT)
        engine.save_checkpoint(str(root), client_state={"epoch": 2, "note": "mid-run"})
        engine.destroy()
        if comm.get_rank() == 0:
            for name in ("zero_to_fp32.py", "zero_to_torch.py"):
                (root / name).unlink(missing_ok=True)
            out = str(root / "global_step3_universal")
            code = minispeed_main(["consolidate", str(root), out, "--to", "deepspeed-universal"])
            assert code == 0, code
        comm.barrier()


if __name__ == "__main__":
    main()
