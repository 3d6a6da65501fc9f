"""The JSON Schema lists exactly the keys the engine accepts, and the reference page is its
rendering (so the docs cannot drift from the checks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minispeed.engine.config import READ, UNSUPPORTED, EngineConfig
from minispeed.engine.config.schema import config_schema, reference_markdown

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = config_schema()
# A value each listed key accepts, by JSON type (a key's own default when it has one).
SAMPLE = {"boolean": False, "integer": 1, "number": 1.0, "string": "x", "array": []}
OVERRIDES = {
    ("pipeline", "partition_method"): "parameters",
    ("pipeline", "partition"): "uniform",
    ("pipeline", "schedule"): "1f1b",
    ("flops_profiler", "output_file"): None,
    ("activation_checkpointing", "number_checkpoints"): None,
    ("zero_optimization", "stage3_trace_check"): "first",
    ("zero_optimization", "zero_hpz_partition_size"): 1,
}
SECTIONS = [
    "zero_optimization",
    "fp16",
    "flops_profiler",
    "pipeline",
    "comms_logger",
    "activation_checkpointing",
]


def test_schema_lists_every_top_level_key_the_engine_reads_or_refuses() -> None:
    assert set(SCHEMA["properties"]) == READ | set(UNSUPPORTED)
    assert SCHEMA["additionalProperties"] is False


def _sample(section: str, key: str, prop: dict):
    if (section, key) in OVERRIDES:
        return OVERRIDES[section, key]
    if "default" in prop:
        return prop["default"]
    if "const" in prop:
        return prop["const"]
    if "enum" in prop:
        return prop["enum"][0]
    kind = prop["type"][0] if isinstance(prop["type"], list) else prop["type"]
    return SAMPLE[kind] if kind != "object" else {"device": "none"}


@pytest.mark.parametrize("section", SECTIONS)
def test_every_key_the_schema_lists_is_accepted(section: str) -> None:
    props = SCHEMA["properties"][section]["properties"]
    assert props, section
    for key, prop in props.items():
        value = _sample(section, key, prop)
        ds = {"train_micro_batch_size_per_gpu": 1, section: {key: value}}
        if section == "fp16":
            ds[section]["enabled"] = True
        EngineConfig.from_ds_config(ds)  # raises if the schema lists a key the engine refuses


@pytest.mark.parametrize("section", SECTIONS)
def test_a_key_the_schema_does_not_list_is_refused(section: str) -> None:
    with pytest.raises(ValueError, match="nosuchkey"):
        EngineConfig.from_ds_config(
            {"train_micro_batch_size_per_gpu": 1, section: {"nosuchkey": 1}}
        )


def test_example_configs_fit_the_schema() -> None:
    for path in sorted((ROOT / "examples" / "configs").glob("*.json")):
        ds = json.loads(path.read_text())
        assert set(ds) <= set(SCHEMA["properties"]), path
        EngineConfig.from_ds_config(ds, data_parallel_size=2)


def test_reference_page_is_the_schema_rendered() -> None:
    page = ROOT / "docs" / "engine" / "config-reference.md"
    assert page.read_text() == reference_markdown(), (
        "docs/engine/config-reference.md is stale: run "
        "`python -m minispeed.engine.config reference --out docs/engine/config-reference.md`"
    )


def test_schema_command_writes_json(tmp_path) -> None:
    out = tmp_path / "schema.json"
    subprocess.run(
        [sys.executable, "-m", "minispeed.engine.config", "schema", "--out", str(out)],
        check=True,
        capture_output=True,
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(SCHEMA))
