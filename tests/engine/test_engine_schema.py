"""The JSON Schema lists exactly the keys the engine accepts, at every depth, with the defaults the
engine applies; the reference page is its rendering; every error names the key as written.

The schema and the checks are generated from the same dataclasses (docs/architecture.md, "The
config pattern"). These tests hold them to what the engine really does: each key the schema
lists is accepted, each key a section's check accepts is listed, each default listed is the one
applied, and a bad value anywhere is refused with the user's key path first."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from minispeed.core.config import ConfigError
from minispeed.core.sections import is_alias, is_unsupported, section_rows
from minispeed.engine.cli.resolved import resolved_rows
from minispeed.engine.config import READ, UNSUPPORTED, EngineConfig
from minispeed.engine.config.schema import config_schema, reference_markdown

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = config_schema()
BASE = {"train_micro_batch_size_per_gpu": 2}
# A value each listed key accepts, by JSON type (a key's own default or first choice first).
SAMPLE = {"boolean": False, "integer": 1, "number": 1.0, "string": "x", "array": [], "null": None}
ACCEPTED = {  # keys whose accepted values no JSON type names
    "pipeline.partition_method": "parameters",
    "pipeline.partition": "uniform",
    "optimizer.type": "AdamW",
    "scheduler.type": "WarmupLR",
    "train_batch_size": 2,  # micro 2 x accumulation 1 x 1 rank
}


def _walk(prop: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (dotted path, property) of the schema, depth first; sections too."""
    for key, sub in prop.get("properties", {}).items():
        where = f"{path}.{key}" if path else key
        yield where, sub
        if sub.get("properties") and not is_alias(sub):
            yield from _walk(sub, where)


KEYS = [(p, s) for p, s in _walk(SCHEMA) if not s.get("properties")]
SECTIONS = [p for p, s in _walk(SCHEMA) if s.get("properties") and not is_alias(s)]


def _with(path: str, value: Any) -> dict[str, Any]:
    """BASE with `value` at `path`, and what the key's section needs to be read: fp16 enabled
    (its keys are read only then), an offload device (and the stage it needs), an optimizer or
    scheduler type."""
    ds: dict[str, Any] = json.loads(json.dumps(BASE))
    top, *rest = path.split(".")
    if top == "fp16" and rest != ["enabled"]:
        ds["fp16"] = {"enabled": True}
    if path.startswith("zero_optimization.offload_"):
        where = rest[0]
        ds["zero_optimization"] = {
            "stage": 3 if where == "offload_param" else 2,
            where: {"device": "cpu"},
        }
    if top in ("optimizer", "scheduler") and rest != ["type"]:
        ds[top] = {"type": ACCEPTED[f"{top}.type"]}
    node = ds
    for key in path.split(".")[:-1]:
        node = node.setdefault(key, {})
    node[path.split(".")[-1]] = value
    return ds


def _sample(path: str, prop: dict[str, Any]) -> Any:
    if path in ACCEPTED:
        return ACCEPTED[path]
    for field in ("default", "const"):
        if field in prop:
            return prop[field]
    if "enum" in prop:
        return prop["enum"][0]
    if "anyOf" in prop:
        return SAMPLE[prop["anyOf"][0]["type"]]
    kind = prop["type"][0] if isinstance(prop["type"], list) else prop["type"]
    return SAMPLE.get(kind, {})


def test_schema_lists_every_top_level_key_the_engine_reads_or_refuses() -> None:
    assert set(SCHEMA["properties"]) == READ | set(UNSUPPORTED)
    assert SCHEMA["additionalProperties"] is False


@pytest.mark.parametrize("path", [p for p, s in KEYS if not is_unsupported(s)])
def test_every_key_the_schema_lists_is_accepted(path: str) -> None:
    prop = dict(KEYS)[path]
    EngineConfig.from_ds_config(_with(path, _sample(path, prop)))  # raises if refused


@pytest.mark.parametrize("path", SECTIONS)
def test_every_section_accepts_exactly_the_keys_the_schema_lists(path: str) -> None:
    """The keys a section's check accepts (it lists them when it refuses one) are the schema's
    keys at that path, nested sections included: a key a package reads but the schema omits
    fails here, and so does one the schema lists that no package accepts."""
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_ds_config(_with(f"{path}.nosuchkey", 1))
    assert err.value.path == f"{path}.nosuchkey"
    section = dict(_walk(SCHEMA))[path]
    listed = {k for k, v in section["properties"].items() if not is_unsupported(v)}
    accepted = set(err.value.reason.split(": ", 1)[1].split(", "))
    assert accepted == listed
    assert section["additionalProperties"] is False


def _unknown(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """What an editor flags: the keys of `value` that an object of `schema` does not allow."""
    if not isinstance(value, dict) or "properties" not in schema:
        return []
    out = []
    for key, sub in value.items():
        where = f"{path}.{key}" if path else key
        if key in schema["properties"]:
            out += _unknown(schema["properties"][key], sub, where)
        elif schema.get("additionalProperties") is False:
            out.append(where)
    return out


def test_an_editor_flags_a_misspelled_key_three_levels_deep() -> None:
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"devise": "cpu"}}}
    assert _unknown(SCHEMA, ds) == ["zero_optimization.offload_optimizer.devise"]
    offload = SCHEMA["properties"]["zero_optimization"]["properties"]["offload_optimizer"]
    assert {"device", "nvme_path", "buffer_count", "pin_memory"} <= set(offload["properties"])


# Values no key takes all of: a JSON object, a negative count, a word, a fraction, a flag, a list.
BAD = [{"bogus": 1}, -7, "bogus", 1.5, True, [1]]
TAKES_ANY_OBJECT = {"optimizer.params", "scheduler.params"}


@pytest.mark.parametrize("path", [p for p, _ in KEYS])
def test_a_bad_value_anywhere_is_named_by_the_key_as_written(path: str) -> None:
    """Issue 32.3: every value error reached from a ds_config starts with the key path the
    user wrote, then the value and the fix (internal names may follow in parentheses)."""
    refused = []
    for bad in BAD:
        try:
            EngineConfig.from_ds_config(_with(path, bad))
        except (ValueError, TypeError) as e:
            assert isinstance(e, ConfigError), f"{path}={bad!r}: {type(e).__name__}: {e}"
            # a section read whole (`compression_training`) may name the key below it
            named = str(e).startswith(f"{path}: ") or str(e).startswith(f"{path}.")
            assert named, f"{path}={bad!r}: {e}"
            refused.append(bad)
    if path not in TAKES_ANY_OBJECT:
        assert refused, f"{path} took every one of {BAD}"


def _initialize_error(rank: int, world_size: int, ds: dict[str, Any]) -> str:
    import torch

    import minispeed.engine as deepspeed

    model = torch.nn.Linear(4, 4)
    try:
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_initialize_names_the_key_the_user_wrote() -> None:
    """The four cases of issue 32.3, through `initialize` (one process): each message starts
    with the key as written; the optimizer constructor's bare "Invalid learning rate" too."""
    from minispeed.core.testing import run_distributed

    adamw = {"type": "AdamW", "params": {"lr": 1e-3}}
    cases = {
        "gradient_clipping": {**BASE, "gradient_clipping": -1},
        "fp16.loss_scale": {**BASE, "fp16": {"enabled": True, "loss_scale": -2}},
        "zero_optimization.reduce_bucket_size": {
            **BASE,
            "zero_optimization": {"stage": 1, "reduce_bucket_size": -5},
        },
        "optimizer.params.lr": {**BASE, "optimizer": {**adamw, "params": {"lr": -1}}},
    }
    for path, ds in cases.items():
        message = run_distributed(_initialize_error, world_size=1, args=(ds,), timeout_s=120)[0]
        assert message.startswith(f"{path}: "), message
        assert "-1" in message or "-2" in message or "-5" in message, message


def test_every_default_listed_is_the_one_the_engine_applies() -> None:
    """Issue 32.8: with every section present and empty, each key with a listed default resolves
    to it (`minispeed report --config` calls that source "default"); gradient_clipping's is
    DeepSpeed's 1.0, the norm ZeRO clips at."""
    ds = {
        **BASE,
        **{s: {} for s in SCHEMA["properties"] if dict(_walk(SCHEMA))[s].get("properties")},
    }
    for name in ("optimizer", "scheduler", "bfloat16"):
        ds.pop(name)
    cfg = EngineConfig.from_ds_config(ds)
    rows = {k: (v, src) for k, v, src in resolved_rows(cfg)}
    listed = {
        p: s["default"]
        for p, s in KEYS
        if "default" in s and not is_unsupported(s) and not is_alias(s)
    }
    assert listed
    for path, default in listed.items():
        if path.split(".")[0] in ("optimizer", "scheduler"):
            continue
        assert rows[path] == (default, "default"), (path, rows[path], default)
    # The engine applies the top-level default through ZeRO: the norm clipped at.
    assert SCHEMA["properties"]["gradient_clipping"]["default"] == 1.0 == cfg.zero.max_grad_norm
    # Sections off in the config (the offload ones) are still read with the listed defaults.
    from minispeed.offload import AioConfig, OffloadOptimizerConfig, OffloadParamConfig

    for cls, path in (
        (OffloadOptimizerConfig, "zero_optimization.offload_optimizer"),
        (OffloadParamConfig, "zero_optimization.offload_param"),
        (AioConfig, "aio"),
    ):
        for key, value, source in section_rows(cls, cls.from_section({}), {}, path):
            assert source == "default", (key, value)


def test_example_configs_fit_the_schema() -> None:
    for path in sorted((ROOT / "examples" / "configs").glob("*.json")):
        ds = json.loads(path.read_text())
        assert _unknown(SCHEMA, ds) == [], path
        if path.stem.endswith("_template"):  # "auto" values the Trainer fills in first
            continue  # (tests/engine/test_compat_paths.py fills and loads it)
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
