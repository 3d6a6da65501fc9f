"""A NaN in one rank's gradients under ZeRO-Infinity (parameters and optimizer on NVMe): the step
is skipped, as at stage 3 in memory.

DeepSpeed's NVMe offload needs its `async_io` op, which does not build on this host (no libaio),
so there is no DeepSpeed record with NVMe; the rule is `LossScaler.checks`' for stage 3 (fp32 and
bf16 are checked), and offloading changes no arithmetic. So `scripts/record_ds_nan_skip.py`'s
stage-3 cases run here with `offload_param` and `offload_optimizer` on NVMe, and every rank's
record must equal DeepSpeed's stage-3 record in memory (`fixtures/ds_nan_skip.json`): the bad
step not applied, `skipped_steps` 1, the norm infinite, the learning rate held, the parameters
after the last step DeepSpeed's. Around the skipped step the parameters and the optimizer state
read back from its swap files are unchanged.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

from minispeed.core.testing import run_distributed

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_nan_skip.json"
STAGE3 = [(3, "fp32", None), (3, "bf16", None)]


def _nvme_nan_skip(rank: int, world_size: int, nvme: str) -> dict:
    script = ds_scripts.load("record_ds_nan_skip.py", ds_scripts.PLAIN_IMPORTS)
    in_memory = script.config
    folder = Path(nvme) / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)

    def config(stage, dtype, check):
        cfg = in_memory(stage, dtype, check)
        offload = {"device": "nvme", "nvme_path": str(folder)}
        cfg["zero_optimization"] |= {"offload_param": offload, "offload_optimizer": offload}
        return cfg | {"zero_force_ds_cpu_optimizer": False}  # the script's torch AdamW

    script.config = config
    records = [script.run_case(rank, *case) for case in STAGE3]
    return {"records": records, "around_skip": _around_skip(script, rank, config)}


def _around_skip(script, rank: int, config) -> dict:
    """The script's loop up to its bad step, with the parameters and the optimizer's swapped
    state (masters, exp_avg, exp_avg_sq read back from the files) before and after it."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(
        torch.nn.Linear(script.DIM, script.DIM), torch.nn.Tanh(), torch.nn.Linear(script.DIM, 1)
    )
    engine, _, _, _ = script.deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config=config(3, "fp32", None),
    )

    def snapshot() -> list[torch.Tensor]:
        with script.deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().clone() for p in engine.module.parameters()]
        return params + list(_tensors(engine.optimizer.state_dict()))

    for step in range(script.BAD_STEP + 1):
        if step == script.BAD_STEP:
            before = snapshot()
        loss = engine(torch.randn(2, script.DIM)).pow(2).mean()
        if step == script.BAD_STEP and rank == script.BAD_RANK:
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
    after = snapshot()
    engine.destroy()
    return {
        "tensors": len(before),
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
        "finite": all(bool(torch.isfinite(t).all()) for t in after),
        "applied": engine.was_step_applied(),
    }


def _tensors(state):
    """Every tensor in a (nested) state dict, copied."""
    if torch.is_tensor(state):
        yield state.clone()
    elif isinstance(state, dict | list | tuple):
        for item in state.values() if isinstance(state, dict) else state:
            yield from _tensors(item)


def test_nan_under_nvme_offload_skips_the_step_as_stage_3_in_memory(tmp_path) -> None:
    fixture = json.loads(FIXTURE.read_text())
    runs = run_distributed(_nvme_nan_skip, world_size=2, args=(str(tmp_path),), timeout_s=300)
    for ours, ref in zip(runs, fixture["ranks"], strict=True):
        in_memory = [case for case in ref if tuple(case["case"]) in STAGE3]
        for case_ours, case_ref in zip(ours["records"], in_memory, strict=True):
            rel = 1e-2 if case_ref["case"][1] == "bf16" else 1e-5
            ds_scripts.assert_matches(case_ours, case_ref, rel, str(case_ref["case"]))
        around = ours["around_skip"]
        assert around["tensors"] > 4 and around["finite"] and not around["applied"], around
        assert around["unchanged"], around
