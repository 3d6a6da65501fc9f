"""Our config's keys against DeepSpeed 0.19.8's, checked from outside: every key DeepSpeed reads
(`tests/engine/fixtures/ds_config_keys.json`, recorded from DeepSpeed itself by
`scripts/record_ds_config_keys.py`) is one our schema lists: read, or refused by name with the
reason and what to use instead (accepted at DeepSpeed's default where that changes nothing),
never an unknown key; every key we read is DeepSpeed's or listed as our own; and where both read
a key, both apply the same default unless listed (and the reference page says why). A key DeepSpeed adds,
or one we add, fails here until it is read or listed: the differences stay written down.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from minispeed.core.sections import is_alias, is_unsupported
from minispeed.engine.config.schema import config_schema

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "ds_config_keys.json"
RECORDED = json.loads(FIXTURE.read_text())
DS: dict[str, dict[str, Any]] = RECORDED["keys"]
SCHEMA = config_schema()

# Keys we refuse by name but accept at one value that is not DeepSpeed 0.19.8's default (the
# value that says what minispeed does), and why.
ACCEPTED_DIFFER: dict[str, str] = {
    "data_types.keep_in_fp32_modules": "DeepSpeed's \"auto\" keeps a model's "
    "_keep_in_fp32_modules in fp32; we keep none, which [] says",
    "zero_optimization.cpu_offload": "DeepSpeed's null; false (what old configs write) means the "
    "same there",
    "zero_optimization.cpu_offload_param": "as cpu_offload",
    "zero_optimization.cpu_offload_use_pin_memory": "as cpu_offload",
    "optimizer.legacy_fusion": "DeepSpeed reads it with .get (null) and means false; false is "
    "what configs write",
}

# DeepSpeed 0.19.8 keys refused by name at every value: no value of them means what we do.
REFUSED_ALWAYS: dict[str, str] = {
    "tensor_parallel.dtype": "DeepSpeed's default is a torch dtype, no JSON value",
    "zero_optimization.leaf_module": "its default names MoE classes DeepSpeed keeps whole; ours "
    "are set in code",
    "timers": "DeepSpeed's throughput timers; wall_clock_breakdown turns ours on",
    "weight_quantization": "post-training int8 lives in minispeed.inference.quantize",
}

# Keys we read that DeepSpeed 0.19.8 does not, and why.
OURS_ONLY: dict[str, str] = {
    "aio.thread_count": "DeepSpeed's pre-0.14 spelling of aio.intra_op_parallelism",
    "checkpoint.async_save": "save_checkpoint writes in the background (our own)",
    "fp16.raise_error_at_min_scale": "DeepSpeed 0.19.8 no longer reads it (it always raises)",
    "pipeline.partition_method": "PipelineModule's partition_method, readable from the config",
    "pipeline.schedule": "our choice of pipeline schedule (1F1B, GPipe, interleaved)",
    "pipeline.virtual_stages": "the interleaved schedule's model chunks per rank",
    "zero_optimization.offload_optimizer.pipeline": "DeepSpeed reads pipeline_read and "
    "pipeline_write; ours also takes the pair's older single switch",
}

# Features DeepSpeed 0.19.8 removed (it refuses their keys with its own message) that we keep.
KEPT_REMOVED: dict[str, str] = {
    "zero_optimization.mics_shard_size": "MiCS is ours (issue 35)",
    "zero_optimization.mics_hierarchical_params_gather": "MiCS is ours (issue 35)",
    "compression_training": "minispeed.compression (DeepSpeed 0.17.6's library, recorded there)",
    "progressive_layer_drop": "minispeed.engine.legacy (DeepSpeed 0.17.6's, recorded there)",
    "curriculum_learning": "minispeed.engine.legacy, seqlen (DeepSpeed 0.17.6's, recorded there)",
    "elasticity": "minispeed.engine.elastic (DeepSpeed 0.17.6's, recorded there)",
}

# Keys both read whose default differs, and why.
DEFAULTS_DIFFER: dict[str, str] = {
    "zero_optimization.offload_optimizer.pin_memory": "page-locked only when asked (mlock on a "
    "CPU-only host needs the privilege)",
    "zero_optimization.offload_param.pin_memory": "as offload_optimizer.pin_memory",
    "zero_optimization.offload_param.max_in_cpu": "null: every shard to NVMe unless a count is "
    "given (DeepSpeed keeps the first 1e9 elements in host memory)",
    "pipeline.seed_layers": "ours seeds layer i with i by default; DeepSpeed leaves torch's RNG",
}


def _ours(path: str) -> str | None:
    """How our schema takes `path`: "read", "refused" (named as DeepSpeed's and refused, or
    accepted at its default only), or None (unknown to it). Alias sections resolve to the key
    they are another name of; a key under an open object (`optimizer.params`) is read."""
    props, node = SCHEMA["properties"], None
    for key in path.split("."):
        if node is not None and "properties" not in node:
            return "read" if node.get("type") == "object" else None  # an open object
        if key not in props:
            return None
        node = props[key]
        if is_alias(node):
            node = props[re.search(r"`([^`]+)`", node["description"]).group(1)]
        if is_unsupported(node):
            return "refused"
        props = node.get("properties", {})
    return "read"


def _canonical(path: str) -> str:
    """`path` with each alias section replaced by the key it is another name of
    (`bfloat16.x` -> `bf16.x`)."""
    props, out = SCHEMA["properties"], []
    for key in path.split("."):
        node = props.get(key, {})
        if is_alias(node):
            key = re.search(r"`([^`]+)`", node["description"]).group(1)
            node = props[key]
        out.append(key)
        props = node.get("properties", {})
    return ".".join(out)


def _listed(path: str, listing: dict[str, str]) -> bool:
    path = _canonical(path)
    return any(path == k or path.startswith(f"{k}.") for k in listing)


def _schema_keys(prop: dict[str, Any], path: str = "") -> list[str]:
    out = []
    for key, sub in prop.get("properties", {}).items():
        where = f"{path}.{key}" if path else key
        if is_alias(sub) or is_unsupported(sub):
            continue
        out.append(where)
        out += _schema_keys(sub, where)
    return out


def test_every_deepspeed_key_is_read_or_refused_by_name() -> None:
    """A genuine DeepSpeed 0.19.8 config never meets "unknown key": each key it may hold is read
    or refused naming why and what to use instead."""
    unknown = [p for p in DS if _ours(p) is None]
    assert unknown == [], f"DeepSpeed 0.19.8 keys we neither read nor refuse by name: {unknown}"


def _refusal(path: str) -> dict[str, Any] | None:
    """The schema entry of `path` when it is refused by name itself (None for a key inside a
    refused section: the section is refused or accepted whole)."""
    props, node = SCHEMA["properties"], {}
    for key in _canonical(path).split("."):
        if key not in props or is_unsupported(node):
            return None
        node = props[key]
        props = node.get("properties", {})
    return node if is_unsupported(node) else None


def test_a_key_refused_by_name_is_accepted_at_deepspeeds_default_unless_listed() -> None:
    """Where a DeepSpeed key holds its default (DeepSpeed's own full config, the Trainer's), the
    config loads: the value accepted is DeepSpeed's, or listed with why it is not; refused at
    every value only where DeepSpeed's default is no JSON value minispeed can mean."""
    refusals = {p: _refusal(p) for p in DS if p not in RECORDED["removed"]}
    refusals = {p: r for p, r in refusals.items() if r is not None}
    assert len(refusals) > 80
    differ = {}
    for path, refusal in refusals.items():
        ours, theirs = refusal.get("default", "refused"), DS[path]["default"]
        # A section left out or written empty, DeepSpeed's default, is accepted whole.
        empty = DS[path]["kind"] == "section" and theirs in (None, {}) and isinstance(ours, dict)
        if ours != theirs and not empty:
            differ[_canonical(path)] = (ours, theirs)
    assert sorted(differ) == sorted([*ACCEPTED_DIFFER, *REFUSED_ALWAYS]), differ


def test_a_key_refused_by_name_says_why_and_what_to_use() -> None:
    from minispeed.core.config import ConfigError
    from minispeed.engine.config import EngineConfig

    config = {"train_batch_size": 2, "zero_optimization": {"leaf_module": {"classes": ["X"]}}}
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_ds_config(config, data_parallel_size=1)
    assert str(err.value) == (
        "zero_optimization.leaf_module: DeepSpeed's 'leaf_module' is not supported by "
        "minispeed: leaf modules are set in code: deepspeed.utils.set_z3_leaf_modules(model, "
        "classes) or minispeed.zero.set_leaf_module; remove it"
    )
    config = {"train_batch_size": 2, "data_parallel_size": 2}
    with pytest.raises(
        ConfigError, match=r"^data_parallel_size: .*pipeline stages.*null is accepted"
    ):
        EngineConfig.from_ds_config(config, data_parallel_size=1)


def test_every_key_we_read_is_deepspeeds_or_listed_as_ours() -> None:
    ours = [p for p in _schema_keys(SCHEMA) if p not in DS and not _listed(p, KEPT_REMOVED)]
    assert sorted(ours) == sorted(OURS_ONLY), "keys we read that DeepSpeed 0.19.8 does not"


def test_the_listed_differences_are_still_differences() -> None:
    """A list entry that stopped being a difference (we read the key now, DeepSpeed dropped it)
    fails here, so the lists stay exact."""
    for path in ACCEPTED_DIFFER:
        assert path in DS and _ours(path) == "refused", path
    for path in DEFAULTS_DIFFER:
        assert path in DS and _ours(path) == "read", path


def test_features_deepspeed_removed_are_refused_by_name_unless_kept() -> None:
    removed = RECORDED["removed"]
    assert set(KEPT_REMOVED) <= set(removed)
    for path in removed:
        want = "read" if path in KEPT_REMOVED else "refused"
        assert _ours(path) == want, (path, _ours(path), removed[path])


def _defaults(prop: dict[str, Any], path: str = "") -> dict[str, Any]:
    out = {}
    for key, sub in prop.get("properties", {}).items():
        where = f"{path}.{key}" if path else key
        if is_alias(sub) or is_unsupported(sub):
            continue
        if sub.get("properties"):
            out |= _defaults(sub, where)
        elif "default" in sub:
            out[where] = sub["default"]
    return out


def test_where_both_read_a_key_the_defaults_are_deepspeeds_unless_listed() -> None:
    """steps_per_print (null: never print), zero_force_ds_cpu_optimizer (true),
    gradient_clipping (1.0) among them."""
    shared = {p: v for p, v in _defaults(SCHEMA).items() if p in DS and DS[p]["kind"] == "key"}
    differ = {p: (v, DS[p]["default"]) for p, v in shared.items() if v != DS[p]["default"]}
    assert sorted(differ) == sorted(DEFAULTS_DIFFER), differ
    for path in DEFAULTS_DIFFER:  # the reference page says so, and why
        node: dict[str, Any] = {"properties": SCHEMA["properties"]}
        for key in path.split("."):
            node = node["properties"][key]
        assert "DeepSpeed's default is" in node["description"], path
    assert shared["steps_per_print"] is None and DS["steps_per_print"]["default"] is None
    assert shared["zero_force_ds_cpu_optimizer"] is True
    assert shared["gradient_clipping"] == DS["gradient_clipping"]["default"] == 1.0


def test_the_stage3_keys_are_read_under_deepspeeds_field_names_too() -> None:
    """DeepSpeed's ZeRO model takes `max_live_parameters` for `stage3_max_live_parameters` (its
    field name and its alias): both set the same field here, and both at once must agree."""
    from minispeed.core.config import ConfigError
    from minispeed.zero import ZeroConfig

    pairs = {
        "prefetch_bucket_size": ("stage3_prefetch_bucket_size", 1234),
        "param_persistence_threshold": ("stage3_param_persistence_threshold", 1234),
        "max_live_parameters": ("stage3_max_live_parameters", 1234),
        "max_reuse_distance": ("stage3_max_reuse_distance", 1234),
        "gather_16bit_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", True),
    }
    for field_name, (stage3_name, value) in pairs.items():
        assert DS[f"zero_optimization.{field_name}"]["reader"].endswith(f".{field_name}")
        by_field = ZeroConfig.from_section({"stage": 3, field_name: value})
        assert by_field == ZeroConfig.from_section({"stage": 3, stage3_name: value}), field_name
        assert by_field != ZeroConfig.from_section({"stage": 3}), field_name
        with pytest.raises(ConfigError, match="another name of"):
            ZeroConfig.from_section({"stage": 3, field_name: value, stage3_name: not value})
