"""Record DeepSpeed 0.19.8's public module paths (what a user script may import) as a fixture.

Runs only in the DeepSpeed reference venv, never with minispeed importable:

    env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python scripts/record_ds_modules.py

It writes `tests/engine/fixtures/ds_modules.json`, which `tests/engine/test_compat_paths.py`
holds the `deepspeed` distribution (packages/deepspeed_compat) against: every path listed here
imports with DeepSpeed's meaning, or raises an `ImportError` naming the path and what to use.

The walk reads the installed package's files (nothing is imported: CUDA-only modules fail to
import on CPU and still are paths a user may write). The rule for "public":

- every module and package under `deepspeed`, by file, up to three components below it
  (`deepspeed.a.b.c`);
- except a path with a private component (`_x`), a test (`test`, `tests`, `test_*`), or one in
  a subtree that holds DeepSpeed's machinery rather than an API (`INTERNAL`: op builders and
  C++/CUDA sources, kernel bindings and Triton kernels, inference v2's kernels and model zoo,
  the compile backend's passes and graph code, inference v1's model zoo, the kernel-injection
  containers and presets, the NVMe benchmark scripts, the accelerator back ends other than CPU
  and CUDA);
- plus every module DeepSpeed's API docs (docs/code-docs/source, `automodule`/`autoclass`)
  and its tutorials import (`DOCUMENTED`), each checked to be a file of the package.

The fixture also lists which of them are packages (a refused package's error names the modules
below it too: `scripts/sync_deepspeed_compat.py`).
"""

from __future__ import annotations

from pathlib import Path

import deepspeed
import torch
from ds_fixture import require_deepspeed, write_json

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_modules.json"
MAX_DEPTH = 3
INTERNAL = (
    "deepspeed.ops.op_builder",
    "deepspeed.ops.csrc",
    "deepspeed.ops.transformer.inference",
    "deepspeed.ops.triton_ops",
    "deepspeed.ops.fp_quantizer",
    "deepspeed.inference.v2.kernels",
    "deepspeed.inference.v2.model_implementations",
    "deepspeed.inference.v2.modules",
    "deepspeed.compile.",  # the compile backend's passes and graph code; `deepspeed.compile` stays
    "deepspeed.model_implementations.",  # inference v1's model zoo; the package itself stays
    "deepspeed.module_inject.containers",
    "deepspeed.module_inject.auto_ep_presets",
    "deepspeed.nvme.",  # benchmark scripts; `deepspeed.nvme` itself stays
    "deepspeed.git_version_info_installed",
    *(
        f"deepspeed.accelerator.{name}_accelerator"
        for name in ("hpu", "klxpu", "mlu", "mps", "npu", "sdaa", "supa", "xpu")
    ),
)
DOCUMENTED = (
    "deepspeed.accelerator",
    "deepspeed.autotuning.autotuner",
    "deepspeed.comm",
    "deepspeed.inference.config",
    "deepspeed.inference.engine",
    "deepspeed.moe.layer",
    "deepspeed.ops.adagrad",
    "deepspeed.ops.adam",
    "deepspeed.ops.lamb",
    "deepspeed.ops.lion",
    "deepspeed.pipe",
    "deepspeed.profiling.flops_profiler",
    "deepspeed.profiling.flops_profiler.profiler",
    "deepspeed.runtime.activation_checkpointing.checkpointing",
    "deepspeed.runtime.fp16.loss_scaler",
    "deepspeed.runtime.lr_schedules",
    "deepspeed.runtime.pipe.engine",
    "deepspeed.runtime.pipe.module",
    "deepspeed.runtime.pipe.topology",
    "deepspeed.runtime.zero.partition_parameters",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.utils.zero_to_fp32",
)


def module_paths(root: Path) -> tuple[set[str], set[str]]:
    """Every module path of the package at `root` (files and packages, none imported), and
    which of them are packages (a folder of modules)."""
    paths, packages = set(), set()
    for file in root.rglob("*.py"):
        parts = file.relative_to(root.parent).with_suffix("").parts
        paths.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
        packages.update(".".join(parts[:end]) for end in range(1, len(parts)))
    return paths | packages, packages


def public(path: str) -> bool:
    parts = path.split(".")
    if len(parts) > MAX_DEPTH + 1 or any(p.startswith("_") for p in parts):
        return False
    if any(p in ("test", "tests") or p.startswith("test_") for p in parts):
        return False
    return not any(path == i or path.startswith(i.rstrip(".") + ".") for i in INTERNAL)


def main() -> None:
    every, packages = module_paths(Path(deepspeed.__file__).parent)
    missing = [p for p in DOCUMENTED if p not in every]
    assert not missing, f"documented but not in the package: {missing}"
    modules = sorted({p for p in every if public(p)} | set(DOCUMENTED))
    rule = __doc__.split("The rule for")[1].split("\n\nThe fixture")[0].strip()
    write_json(
        {
            "deepspeed": require_deepspeed(),
            "torch": torch.__version__,
            "command": "env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python "
            "scripts/record_ds_modules.py",
            "rule": "The rule for " + rule,
            "walked": len(every),
            "modules": modules,
            "packages": [p for p in modules if p in packages],
        },
        FIXTURE,
    )
    print(f"{len(modules)} of {len(every)} module paths -> {FIXTURE}")


if __name__ == "__main__":
    main()
