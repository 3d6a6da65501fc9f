"""Record DeepSpeed 0.19.8's memory estimators as a JSON test fixture.

Runs only in the DeepSpeed reference venv, never with minispeed importable:

    env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python scripts/record_ds_estimates.py

It writes `tests/engine/fixtures/ds_estimates.json`: for a grid of (parameters, largest layer,
GPUs per node, nodes, buffer factor), what
`deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs` and
`deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs` return for every option
their `_all_cold` printers loop over, and the text those printers (`_all_cold`, and `_all_live`
for small models built from a layer list the test rebuilds) print.
`tests/engine/test_cli_estimate.py` checks `minispeed.zero.memory.estimate_modes` against it.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.zero import stage3
from deepspeed.runtime.zero import stage_1_and_2 as stage12

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_estimates.json"

# (total params, largest layer params): from a toy size to 70B with a LLaMA-like largest layer.
SIZES = [(1_000_003, 65_536), (125e6, 38_597_376), (1.3e9, 128_778_240), (7e9, 131_072_000),
         (70e9, 1_048_576_000)]  # fmt: skip
LAYOUTS = [(1, 1), (8, 1), (8, 4), (3, 2)]  # (GPUs per node, nodes)
FACTORS = [1.5, 1.0]

# Small live models: a list of layers (kind, *shape) and whether the head is tied to the
# embedding. The test builds the same nn.Sequential with `build_model` (copied there).
LIVE_MODELS: list[dict[str, Any]] = [
    {"layers": [["Embedding", 1000, 64], ["Linear", 64, 256], ["LayerNorm", 256],
                ["Linear", 256, 64], ["Linear", 64, 1000]], "tie_head": True},
    {"layers": [["Embedding", 50, 32], ["Linear", 32, 32], ["Linear", 32, 50]], "tie_head": False},
    {"layers": [["Embedding", 32000, 1024], ["Linear", 1024, 4096], ["Linear", 4096, 1024],
                ["Linear", 1024, 32000]], "tie_head": True},
]  # fmt: skip


def build_model(spec: dict[str, Any]) -> torch.nn.Module:
    """The nn.Sequential a LIVE_MODELS entry describes (tied head: shares the embedding)."""
    layers = [getattr(torch.nn, kind)(*shape) for kind, *shape in spec["layers"]]
    if spec["tie_head"]:
        layers[-1].weight = layers[0].weight
    return torch.nn.Sequential(*layers)


def printed(fn, *args, **kwargs) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args, **kwargs)
    return out.getvalue()


def main() -> None:
    cold = []
    for psi, largest in SIZES:
        psi, largest = int(psi), int(largest)
        for gpn, nodes in LAYOUTS:
            for f in FACTORS:
                args = dict(num_gpus_per_node=gpn, num_nodes=nodes, additional_buffer_factor=f)
                z2 = {
                    str(off): stage12.estimate_zero2_model_states_mem_needs(
                        psi, cpu_offload=off, **args
                    )
                    for off in (True, False)
                }
                z3 = {
                    f"{opt},{par},{zi}": stage3.estimate_zero3_model_states_mem_needs(
                        psi, largest, cpu_offload=opt, cpu_offload_params=par, zero_init=zi, **args
                    )[:2]
                    for opt in (True, False)
                    for par in (True, False)
                    for zi in (True, False)
                    if opt or not par
                }
                cold.append({
                    "total_params": psi,
                    "largest_layer_params": largest,
                    **args,
                    "zero2": z2,  # cpu_offload -> (cpu bytes, gpu bytes)
                    "zero3": z3,  # "cpu_offload,cpu_offload_params,zero_init" -> (cpu, gpu)
                    "zero2_printed": printed(
                        stage12.estimate_zero2_model_states_mem_needs_all_cold, psi, **args
                    ),
                    "zero3_printed": printed(
                        stage3.estimate_zero3_model_states_mem_needs_all_cold, psi, largest, **args
                    ),
                })  # fmt: skip
    live = []
    for spec in LIVE_MODELS:
        for gpn, nodes in LAYOUTS[:3]:
            model = build_model(spec)
            args = dict(num_gpus_per_node=gpn, num_nodes=nodes)
            live.append({
                "model": spec,
                **args,
                "model_to_params": stage3.model_to_params(model),
                "zero2_printed": printed(
                    stage12.estimate_zero2_model_states_mem_needs_all_live, model, **args
                ),
                "zero3_printed": printed(
                    stage3.estimate_zero3_model_states_mem_needs_all_live, model, **args
                ),
            })  # fmt: skip
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps({"deepspeed": "0.19.8", "cold": cold, "live": live}, indent=1))
    print(f"wrote {FIXTURE}: {len(cold)} cold cases, {len(live)} live cases")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import require_deepspeed

    require_deepspeed()  # refuses minispeed under DeepSpeed's name
    main()
