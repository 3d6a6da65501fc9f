"""Record DeepSpeed 0.19.8's ZeRO config models as a JSON test fixture.

Runs only in the DeepSpeed reference venv, never with minispeed importable:

    env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python scripts/record_ds_zero_config.py

It writes `tests/engine/fixtures/ds_zero_config.json`: for each `zero_optimization` section of
`SECTIONS`, every field of `deepspeed.runtime.zero.config.DeepSpeedZeroConfig(**section)` by its
field name (enums as their values, offload sections as dicts of their fields), and the members of
`ZeroStageEnum` and `OffloadDeviceEnum`. `tests/engine/test_compat_adapters.py` checks
`minispeed.engine.runtime.zero.config` against it.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Any

from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_zero_config.json"

# DeepSpeed's key names (`stage3_` aliases) and its field names both, offload on and off.
SECTIONS: list[dict[str, Any]] = [
    {},
    {"stage": 1, "reduce_bucket_size": 1000},
    {"stage": 2, "overlap_comm": False, "reduce_scatter": False, "allgather_bucket_size": 64},
    {"stage": 3, "stage3_prefetch_bucket_size": 123, "stage3_param_persistence_threshold": 0,
     "stage3_max_live_parameters": 77, "stage3_max_reuse_distance": 5,
     "stage3_gather_16bit_weights_on_model_save": True, "sub_group_size": 4096},
    {"stage": 3, "prefetch_bucket_size": 321, "param_persistence_threshold": 10,
     "offload_param": {"device": "cpu", "pin_memory": True},
     "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    {"stage": 3, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "cpu"}},
    {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
     "zero_quantized_gradients": True},
]  # fmt: skip


def plain(value: Any) -> Any:
    """A JSON value: enums as their values, models as dicts of their fields, paths as text."""
    if isinstance(value, enum.Enum):
        return value.value
    if hasattr(type(value), "model_fields"):
        return {name: plain(getattr(value, name)) for name in type(value).model_fields}
    if isinstance(value, Path):
        return str(value)
    return value


def main() -> None:
    cases = []
    for section in SECTIONS:
        model = DeepSpeedZeroConfig(**section)
        cases.append({"section": section, "fields": plain(model)})
    result = {
        "deepspeed": require_deepspeed(),
        "command": "env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python "
        "scripts/record_ds_zero_config.py",
        "stages": {m.name: m.value for m in ZeroStageEnum.__members__.values()},
        "stage_names": list(ZeroStageEnum.__members__),
        "devices": {m.name: m.value for m in OffloadDeviceEnum},
        "cases": cases,
    }
    write_json(result, FIXTURE, indent=1)
    print(f"wrote {FIXTURE}: {len(cases)} sections")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import require_deepspeed, write_json

    main()
