"""DeepSpeed's flops-profiler strings (`flops_to_string`, `macs_to_string`, `bytes_to_string`,
`duration_to_string`, `params_to_string`, `number_to_string`), which scripts print beside
`get_model_profile(..., as_string=False)`'s numbers, for numbers from micro to peta, with units
forced and a precision given.

Recorded on DeepSpeed 0.19.8 (one process, no GPU needed):

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python scripts/record_ds_profiler_strings.py
```

which writes `tests/engine/fixtures/ds_profiler_strings.json`;
`tests/engine/test_compat_adapters.py` formats the same numbers with minispeed's and compares.
"""

from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_profiler_strings.json"
NUMBERS = [0, 0.00042, 0.0123, 7, 999, 2048, 124564, 3.5e6, 1.5e9, 2.75e12, 6e15]
NAMES = [
    "flops_to_string",
    "macs_to_string",
    "bytes_to_string",
    "duration_to_string",
    "params_to_string",
    "number_to_string",
]


def main():
    import deepspeed.profiling.flops_profiler as profiler

    out = {}
    for name in NAMES:
        f = getattr(profiler, name)
        out[name] = [f(n) for n in NUMBERS] + [f(1.5e9, units="M"), f(1234, precision=0)]
    out["params_to_string(1.5e9, units='B')"] = profiler.params_to_string(1.5e9, units="B")
    return out


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import require_deepspeed, write_json

    result = {"deepspeed": require_deepspeed(), "strings": main()}
    write_json(result, FIXTURE)
