"""`torch_autocast`: fp32 parameters, the forward under torch.autocast, as DeepSpeed 0.19.8.

`scripts/record_ds_autocast.py` (2 ranks, a Linear-LayerNorm-Tanh-Linear model, 3 AdamW steps;
bf16 at ZeRO stages 0-3, at stage 2 with 2 accumulation steps, at stage 1 with
`lower_precision_safe_modules: ["torch.nn.LayerNorm"]`; fp16 at stages 0 and 2; bf16 on a
2-stage pipeline at stages 0 and 1) runs here with its import lines changed to minispeed's. Every loss, and every parameter's sum after the last
step, equals DeepSpeed's to 1e-5 relative (they are bit for bit equal where recorded: the same
torch.autocast forward and the same 16-bit roundings of g/N and of the sum; with the safe
gradients reduced in fp32 instead the parameters differ by more, so this checks the wire dtype
too); the dtype each gradient travels in, the engine's answers and which configs are refused,
exactly.

The bytes: at stages 1-3 the safe parameters' gradients are reduce-scattered in bf16, the others
in fp32, and the comms logger sees exactly `autocast.wire_bytes` of each, the safe ones half of
what fp32 would send.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

import minispeed.comm as comm
import minispeed.engine as deepspeed
import minispeed.zero as zero
from minispeed.core.config import ConfigError
from minispeed.core.testing import run_distributed
from minispeed.engine.config import EngineConfig
from minispeed.zero.autocast import wire_bytes

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_autocast.json"
IMPORTS = {
    **ds_scripts.PLAIN_IMPORTS,
    "from deepspeed.runtime.torch_autocast import get_comm_dtype, has_comm_dtype\n": (
        "from minispeed.engine.runtime.torch_autocast import get_comm_dtype, has_comm_dtype\n"
    ),
    "from deepspeed.pipe import PipelineModule\n": (
        "from minispeed.engine.pipe import PipelineModule\n"
    ),
}
REL = 1e-5


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def _ledger(script) -> dict[int, dict[str, int]]:
    """Per stage 1-3, {dtype: elements reduce-scattered} over one bf16 autocast step, after
    checking each call's wire bytes against `wire_bytes`."""
    out = {}
    n = comm.get_world_size()
    for stage in (1, 2, 3):
        model, optimizer = script.model_and_optimizer()
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=script.config(stage, script.BF16, 1)
        )
        x = torch.randn(2, script.DIM)
        with comm.CommsLogger() as log:
            engine.backward(engine(x).float().pow(2).mean())
        numels: dict[str, int] = {}
        for r in log.records:
            if r.op == "reduce_scatter":
                dtype = getattr(torch, r.dtype.removeprefix("torch."))
                assert r.wire_bytes == wire_bytes([r.numel], [dtype], n), r
                numels[r.dtype] = numels.get(r.dtype, 0) + r.numel
        out[stage] = numels
        engine.destroy()
    return out


def _runs(rank, world_size):
    script = ds_scripts.load("record_ds_autocast.py", IMPORTS)
    return script.main(), _ledger(script)


def test_autocast_trains_as_deepspeed_and_halves_the_safe_gradients_bytes():
    fixture = json.loads(FIXTURE.read_text())
    assert fixture["deepspeed"] == "0.19.8"
    runs = run_distributed(_runs, world_size=2, timeout_s=300)
    for (ours, ledger), ref in zip(runs, fixture["ranks"], strict=True):
        # The plain cases, then the 2-stage pipeline's (each rank one stage, data-parallel size
        # 1) at ZeRO 0 and 1: its losses and its stage's parameters (no engine answers kept).
        pairs = zip(ours["runs"] + ours["pipe"], ref["runs"] + ref["pipe"], strict=True)
        for case_ours, case_ref in pairs:
            where = str(case_ref["case"])
            for name in ("losses", "params"):
                torch.testing.assert_close(
                    torch.tensor(case_ours[name], dtype=torch.float64),
                    torch.tensor(case_ref[name], dtype=torch.float64),
                    rtol=REL,
                    atol=1e-6,
                    msg=lambda m, w=where, k=name: f"{w} {k}: {m}",
                )
            assert case_ours.keys() == case_ref.keys(), where
            for name in ("comm_dtypes", "autocast_dtype", "safe_modules", "case"):
                assert case_ours.get(name) == case_ref.get(name), (where, name)
        assert [r is not None for r in ours["refused"]] == [r is not None for r in ref["refused"]]
        assert all(r is not None for r in ours["refused"])
        # Linear(8, 8) and Linear(8, 1): 72 + 9 safe elements, LayerNorm's 16 not. Stages 1-2
        # pad each bucket (8·8 + 8 | 8 + 1 -> 72 | 10), stage 3 each parameter (64, 8, 8, 2).
        safe = _padded(72, 2) + _padded(9, 2)
        assert safe == 64 + 8 + 8 + _padded(1, 2)
        for stage, numels in ledger.items():
            assert numels == {"torch.bfloat16": safe, "torch.float32": 16}, (stage, numels)
        # What the safe gradients cost on the wire: half of fp32's.
        assert 2 * wire_bytes([safe], [torch.bfloat16], 2) == wire_bytes([safe], [torch.float32], 2)


BF16 = {"enabled": True, "dtype": "bfloat16"}


@pytest.mark.parametrize(
    ("extra", "key", "says"),
    [
        ({"bf16": {"enabled": True}}, "torch_autocast.enabled", "bf16.enabled"),
        ({"fp16": {"enabled": True}}, "torch_autocast.enabled", "fp16.enabled"),
        (
            {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
            "torch_autocast.enabled",
            "zero_quantized_weights",
        ),
        (
            {"torch_autocast": {**BF16, "lower_precision_safe_modules": ["torch.nn.Nope"]}},
            "torch_autocast.lower_precision_safe_modules",
            "torch.nn.Nope",
        ),
        (
            {"torch_autocast": {**BF16, "lower_precision_safe_modules": "torch.nn.Linear"}},
            "torch_autocast.lower_precision_safe_modules",
            "list of class paths",
        ),
        ({"torch_autocast": {"enabled": True, "dtype": "int8"}}, "torch_autocast.dtype", "int8"),
        (
            {"pipeline": {"stages": 2}, "zero_optimization": {"stage": 2}},
            "torch_autocast.enabled",
            "pipeline at zero_optimization.stage 2",
        ),
        (
            {"pipeline": {"stages": 2}, "torch_autocast": {"enabled": True, "dtype": "float16"}},
            "torch_autocast.dtype",
            "float16 with a pipeline",
        ),
    ],
)
def test_refusals_name_the_keys_and_the_fix(extra, key, says):
    ds = {"train_batch_size": 2, "torch_autocast": BF16, **extra}
    with pytest.raises(ConfigError) as e:
        EngineConfig.from_ds_config(ds)
    assert e.value.path == key and says in str(e.value), str(e.value)


def test_the_forward_region_replaces_or_switches_off_an_outer_autocast():
    """The engine's forward region, as DeepSpeed's `autocast_if_enabled`: the section's autocast
    (bf16 matrix products), or, with the section off, none even inside the caller's autocast."""
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with zero.autocast_region(None, "cpu"):
            assert (x @ x.T).dtype == torch.float32
        with zero.autocast_region(zero.Autocast(torch.float16), "cpu"):
            assert (x @ x.T).dtype == torch.float16
    with zero.autocast_region(zero.Autocast(torch.bfloat16), "cpu"):
        assert (x @ x.T).dtype == torch.bfloat16
    with zero.autocast_region(None, "cpu"):
        assert (x @ x.T).dtype == torch.float32
