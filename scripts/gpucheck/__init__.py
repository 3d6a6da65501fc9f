"""The GPU check's pieces: the list of checks (here), the harness, and one module per area.

`scripts/gpu_check.py` is the command (`make gpu-check`); it reads `CHECKS` to know each check's
time budget and runs them in worker processes (`worker.py`). This module imports nothing but the
standard library, so the driver stays free of torch and of any CUDA state.

Reading order: `harness.py` (what a check records: rows, tolerances, findings; timing; the
device), `worker.py` (runs checks one after another, each isolated), then the checks in the order
below: `check_env.py` (the machine, every op's build, the `.cu` coverage), `check_ops.py`
(every CUDA op against its reference), `check_attention.py` (block-sparse attention: the CUDA
kernels through `sparse_cuda.py`, and timings against flash attention), `check_models.py`
(kernel injection of GPT-2 and LLaMA, decode speed), `check_training.py` (ZeRO 0-3 and
ZeRO-Offload against plain PyTorch; the 1B-parameter step's MFU and memory ledger; the
offload step with and without pinned copies), `check_nvtx.py` (ranges seen by an NVTX tool),
`check_speed.py` (the chip's matmul rate, AdamW, the cast op).
"""

from __future__ import annotations

import dataclasses

__all__ = ["CHECKS", "FAULT_CHECKS", "Spec", "spec_of"]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One check: where its function lives and how long it may take."""

    name: str
    target: str  # "module:function" under scripts/gpucheck, called as fn(ctx, report)
    budget_s: float  # on a GPU: killed (status timeout) past this
    need_s: float  # not started when less than this is left of the run's budget
    dry_budget_s: float = 180.0  # the same limit in a dry run (CPU, tiny sizes; a loaded CI box)
    needs_torch: bool = True  # False only for the harness's own fault checks


# Correctness first, then timings (the most wanted first), so a run cut short by its budget
# still answers whether everything works.
CHECKS: tuple[Spec, ...] = (
    Spec("env", "gpucheck.check_env:env", 60, 5),
    Spec("build", "gpucheck.check_env:build", 300, 60, dry_budget_s=900),
    Spec("coverage", "gpucheck.check_env:coverage", 30, 2),
    Spec("op.cast", "gpucheck.check_ops:cast", 60, 5),
    Spec("op.compression", "gpucheck.check_ops:compression", 90, 5),
    Spec("op.moe_permute", "gpucheck.check_ops:moe_permute", 60, 5),
    Spec("op.inference", "gpucheck.check_ops:inference", 90, 5),
    Spec("op.sparse_attention", "gpucheck.check_attention:correctness", 90, 10),
    Spec("inject.gpt2", "gpucheck.check_models:inject_gpt2", 90, 10),
    Spec("inject.llama", "gpucheck.check_models:inject_llama", 90, 10),
    Spec("train.zero", "gpucheck.check_training:zero_parity", 150, 20),
    Spec("nvtx", "gpucheck.check_nvtx:nvtx", 90, 15),
    Spec("speed.matmul", "gpucheck.check_speed:matmul", 30, 5),
    Spec("speed.gpt1b", "gpucheck.check_training:gpt1b", 180, 45),
    Spec("speed.decode", "gpucheck.check_models:decode_speed", 150, 30),
    Spec("speed.sparse_attention", "gpucheck.check_attention:speed", 90, 20),
    Spec("speed.adamw", "gpucheck.check_speed:adamw", 60, 10),
    Spec("speed.cast", "gpucheck.check_speed:cast", 30, 5),
    Spec("speed.offload", "gpucheck.check_training:offload_speed", 120, 30),
)

# The harness's own test (tests/test_gpu_check.py): checks that raise, crash and hang, so the
# isolation of the driver is proven without a GPU. Only `--only fault.*` runs them.
FAULT_CHECKS: tuple[Spec, ...] = (
    Spec("fault.raise", "gpucheck.faults:raise_", 10, 0, 10, needs_torch=False),
    Spec("fault.crash", "gpucheck.faults:crash", 10, 0, 10, needs_torch=False),
    Spec("fault.hang", "gpucheck.faults:hang", 3, 0, 3, needs_torch=False),
    Spec("fault.ok", "gpucheck.faults:ok", 10, 0, 10, needs_torch=False),
)


def spec_of(name: str) -> Spec:
    """The `Spec` named `name` (a check or a fault check)."""
    for spec in CHECKS + FAULT_CHECKS:
        if spec.name == name:
            return spec
    known = ", ".join(s.name for s in CHECKS)
    raise KeyError(f"no check named {name!r}; the checks are: {known}")
