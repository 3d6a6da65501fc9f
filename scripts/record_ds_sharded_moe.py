"""Record DeepSpeed 0.19.8's gating functions (`deepspeed.moe.sharded_moe`) as a JSON fixture.

Runs only in the DeepSpeed reference venv, never with minispeed importable:

    env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python scripts/record_ds_sharded_moe.py

It writes `tests/engine/fixtures/ds_sharded_moe.json`: for each case of `CASES`, the logits, the
arguments and what `top1gating` / `top2gating` / `topkgating` return (`l_aux`, `combine_weights`,
`dispatch_mask`, `exp_counts`), the global RNG seeded with `seed` just before the call (top-1's
random token selection draws from it). `tests/engine/test_compat_adapters.py` checks
`minispeed.engine.moe.sharded_moe` against it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_sharded_moe.json"

# (function, tokens, experts, positional arguments after the logits, keyword arguments, seed)
CASES: list[tuple[str, int, int, list[Any], dict[str, Any], int]] = [
    ("top1gating", 16, 4, [0.5, 1], {"use_rts": False}, 1),
    ("top1gating", 16, 4, [1.0, 2], {"use_rts": False, "drop_tokens": False}, 2),
    ("top1gating", 16, 4, [0.5, 1], {"use_rts": True}, 3),
    ("top1gating", 24, 8, [1.0, 4], {"use_rts": True}, 4),
    ("top2gating", 16, 4, [0.5, 1], {"top2_2nd_expert_sampling": False}, 5),
    ("top2gating", 16, 4, [1.0, 8], {"top2_2nd_expert_sampling": False}, 6),
    ("top2gating", 16, 4, [1.0, 1], {"top2_2nd_expert_sampling": False, "drop_tokens": False}, 7),
    ("topkgating", 16, 6, [3, 0.5, 1], {}, 8),
    ("topkgating", 16, 6, [3, 1.0, 1], {"drop_tokens": False}, 9),
    ("topkgating", 16, 4, [1, 0.5, 1], {"drop_policy": "position"}, 10),
]  # fmt: skip


def main() -> None:
    from deepspeed.moe import sharded_moe

    cases = []
    for name, tokens, experts, args, kwargs, seed in CASES:
        torch.manual_seed(1000 + seed)
        logits = torch.randn(tokens, experts)
        torch.manual_seed(seed)
        l_aux, combine, dispatch, counts = getattr(sharded_moe, name)(
            logits.clone(), *args, **kwargs
        )
        cases.append({
            "function": name, "args": args, "kwargs": kwargs, "seed": seed,
            "logits": logits.tolist(), "l_aux": float(l_aux),
            "combine_weights": combine.tolist(), "dispatch_equals_combine": bool(torch.equal(dispatch, combine.bool())),
            "exp_counts": counts.tolist(),
        })  # fmt: skip
    result = {
        "deepspeed": require_deepspeed(),
        "command": "env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python "
        "scripts/record_ds_sharded_moe.py",
        "cases": cases,
    }
    write_json(result, FIXTURE, indent=None)
    print(f"wrote {FIXTURE}: {len(cases)} cases")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import require_deepspeed, write_json

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)  # DeepSpeed's groups ask for a world
    try:
        main()
    finally:
        dist.destroy_process_group()
