"""A JSON Schema of the whole ds_config, and the config reference page rendered from it.

```bash
python -m minispeed.engine.config schema --out ds_config.schema.json   # editors complete keys
python -m minispeed.engine.config reference --out docs/engine/config-reference.md
```

The schema is built from the same tables the checks use (`engine.config`'s key sets, the
DeepSpeed keys each package translates, the field docstrings of `ZeroConfig`), so a key the
schema lists is one the engine accepts, with the description its owner wrote. Where a package
validates a section's values itself (offload, `aio`, the optimizer's `params`), the schema names
the keys and leaves the values to that package.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from minispeed.core.config import field_docs
from minispeed.engine import config as cfg
from minispeed.engine.checkpoint import grid as checkpoint_keys
from minispeed.engine.checkpoint.grid import CheckpointConfig
from minispeed.zero import ZeroConfig

__all__ = ["config_schema", "reference_markdown"]

SCHEMA_URI = "https://json-schema.org/draft/2020-12/schema"

_JSON_TYPES = {"int": "integer", "bool": "boolean", "float": "number", "str": "string"}
_BATCH = {"anyOf": [{"type": "integer", "minimum": 1}, {"const": "auto"}]}


def _obj(props: dict[str, Any], description: str, *, closed: bool = True) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "properties": props,
        "additionalProperties": not closed,
    }


def _prop(kind: str | list[str], description: str, default: Any = None, **extra: Any) -> dict:
    out: dict[str, Any] = {"type": kind, "description": description, **extra}
    if default is not None:
        out["default"] = default
    return out


def _zero_section() -> dict[str, Any]:
    docs = field_docs(ZeroConfig)
    fields = {f.name: f for f in dataclasses.fields(ZeroConfig)}
    props: dict[str, Any] = {}
    for ds_key, name in ZeroConfig.ds_key_fields().items():
        f = fields[name]
        default = f.default if f.default is not dataclasses.MISSING else None
        props[ds_key] = _prop(_JSON_TYPES.get(str(f.type), "string"), docs.get(name, ""), default)
    props["stage"]["enum"] = [0, 1, 2, 3]
    props["overlap_comm"]["description"] += (
        " Left out: on, except at stage 2 (Note [overlap_comm's default])."
    )
    props["overlap_comm"].pop("default", None)
    device = {"enum": ["none", "cpu", "nvme"], "description": "Where the states live."}
    for key, what in (
        ("offload_optimizer", "fp32 masters and optimizer states off the accelerator (stages 1-3)"),
        ("offload_param", "ZeRO-Infinity: parameter shards off the accelerator (stage 3)"),
    ):
        props[key] = _obj({"device": device}, what, closed=False)
    for key, value in (("allgather_partitions", True), ("round_robin_gradients", False)):
        props[key] = {"const": value, "description": f"Accepted only at {value!r}."}
    return _obj(props, "ZeRO: which stage, its buckets, offload and ZeRO++ (minispeed.zero).")


_FP16 = {
    "enabled": ("boolean", "Train in fp16 with a dynamic loss scale."),
    "loss_scale": ("number", "0: dynamic scaling; > 0: this static scale."),
    "initial_scale_power": ("integer", "The dynamic scale starts at 2**this."),
    "loss_scale_window": ("integer", "Clean steps before the scale doubles."),
    "hysteresis": ("integer", "Overflows tolerated before the scale halves."),
    "consecutive_hysteresis": ("boolean", "Refill the hysteresis after a clean step."),
    "min_loss_scale": ("number", "The scale never goes below this."),
    "raise_error_at_min_scale": ("boolean", "Raise when an overflow happens at the minimum."),
}
_FLOPS = {
    "enabled": ("boolean", "Profile one step."),
    "profile_step": ("integer", "Which optimizer step (counting from 0) is profiled."),
    "module_depth": ("integer", "Levels of the module tree printed (-1: all)."),
    "top_modules": ("integer", "Children printed per module (-1: all)."),
    "detailed": ("boolean", "Print the module tree (false: the totals only)."),
    "output_file": (["string", "null"], "*.json: the profile as JSON; other: text; null: print."),
}
_PIPELINE = {
    "stages": ("integer", "Pipeline stages (the rest of the world is data parallel)."),
    "partition_method": ("string", "'parameters', 'uniform' or 'type:<regex>'."),
    "partition": ("string", "Old name of partition_method."),
    "seed_layers": ("boolean", "Build layer i under seed base_seed + i."),
    "activation_checkpoint_interval": ("integer", "0: off; 1: recompute each stage chunk."),
    "pipe_partitioned": ("boolean", "Accepted only false (no tensor parallelism)."),
    "grad_partitioned": ("boolean", "Accepted only false (no tensor parallelism)."),
    "schedule": ("string", "'gpipe', '1f1b', 'interleaved_1f1b' or 'zb_h1'."),
    "virtual_stages": ("integer", "Chunks per stage for the interleaved schedule."),
}
_ACTIVATION = {
    "cpu_checkpointing": ("boolean", "Keep checkpointed inputs in host memory."),
    "number_checkpoints": (["integer", "null"], "Checkpoints per forward (null: every call)."),
    "synchronize_checkpoint_boundary": ("boolean", "Synchronize the device at each boundary."),
}
_COMMS = {
    "enabled": ("boolean", "Record every collective into engine.comms_logger."),
    "verbose": ("boolean", "Log each collective as it runs."),
    "prof_all": ("boolean", "Record every collective (the default)."),
    "prof_ops": ("array", "Record only these collectives."),
    "debug": ("boolean", "Name the caller of each collective."),
}


def _table(rows: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    return {key: _prop(kind, text) for key, (kind, text) in rows.items()}


def _checkpoint_section() -> dict[str, Any]:
    docs = field_docs(CheckpointConfig)
    props = {key: _prop("boolean", docs[key], False) for key in CheckpointConfig.KEYS}
    props["tag_validation"] = {
        "type": "string",
        "description": docs["tag_validation"],
        "default": "Warn",
    }
    for key, why in sorted(checkpoint_keys.UNSUPPORTED.items()):
        props[key] = {
            "description": f"Not supported: {why}. Accepted at DeepSpeed's default only.",
            "default": checkpoint_keys.DEFAULTS[key],
        }
    return _obj(props, "Checkpoints (minispeed.engine.checkpoint).")


def _typed(name: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": f'The {name} by name: {{"type": ..., "params": {{...}}}}.',
        "properties": {
            "type": {"type": "string", "description": f"The {name}'s DeepSpeed name."},
            "params": {"type": "object", "description": "Its keyword arguments."},
        },
        "required": ["type"],
        "additionalProperties": False,
    }


def config_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of every ds_config key the engine accepts."""
    read: dict[str, Any] = {
        "train_batch_size": {**_BATCH, "description": "Samples per optimizer step, all ranks."},
        "train_micro_batch_size_per_gpu": {
            **_BATCH,
            "description": "Samples per rank per forward.",
        },
        "gradient_accumulation_steps": {**_BATCH, "description": "Micro-batches per step."},
        "optimizer": _typed("optimizer"),
        "scheduler": _typed("scheduler"),
        "fp16": _obj(_table(_FP16), "fp16 mixed precision (minispeed.zero.MixedPrecision)."),
        "bf16": _obj(_table({"enabled": ("boolean", "Train in bf16.")}), "bf16 mixed precision."),
        "bfloat16": {"type": "object", "description": "Old name of bf16."},
        "data_types": _obj(
            {
                "grad_accum_dtype": {
                    "enum": ["fp32", "fp16", "bf16"],
                    "description": "Gradient accumulation and reduction dtype.",
                }
            },
            "Data types.",
        ),
        "zero_optimization": _zero_section(),
        "gradient_clipping": _prop(
            "number", "Clip to this global L2 norm; 0: off.", 0.0, minimum=0
        ),
        "aio": _obj({}, "Asynchronous I/O for NVMe offload (minispeed.offload).", closed=False),
        "steps_per_print": _prop("integer", "Log loss, lr and step time every N steps (rank 0)."),
        "wall_clock_breakdown": _prop("boolean", "Time forward, backward and step.", False),
        "comms_logger": _obj(_table(_COMMS), "The comms logger (minispeed.comm)."),
        "flops_profiler": _obj(_table(_FLOPS), "The FLOPs profiler (minispeed.profiler)."),
        "activation_checkpointing": _obj(_table(_ACTIVATION), "Activation checkpointing."),
        "pipeline": _obj(_table(_PIPELINE), "Pipeline parallelism (minispeed.pipeline)."),
        "checkpoint": _checkpoint_section(),
        "communication_data_type": {
            "enum": ["fp32", "fp16", "bf16", None],
            "description": "Accepted when equal to data_types.grad_accum_dtype.",
        },
        "zero_allow_untested_optimizer": _prop(
            "boolean",
            "Accept an optimizer not known to be elementwise at ZeRO stages 1-3 (refused otherwise).",
        ),
        "zero_force_ds_cpu_optimizer": _prop("boolean", "Accepted; offload picks its CPU op."),
        "tensor_parallel": _obj(
            {
                "autotp_size": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Tensor-parallel size T (0 or 1: off); world = pipe x data x T, "
                    "tensor ranks adjacent. The plan is a ready one by model type or "
                    "initialize(tensor_parallel_plan=...); not inferred as by DeepSpeed's AutoTP.",
                }
            },
            "Tensor parallelism (minispeed.tensor_parallel) on the engine's pipe x data x tensor "
            "grid: ZeRO over the data axis, clipping over all three (docs: 3D parallelism).",
        ),
    }
    unsupported = {
        key: {
            "description": f"Not supported: {why}. "
            + ("Accepted at DeepSpeed's default only." if key in cfg.DEFAULTS else "Refused."),
            **({"default": cfg.DEFAULTS[key]} if key in cfg.DEFAULTS else {}),
        }
        for key, why in sorted(cfg.UNSUPPORTED.items())
    }
    return {
        "$schema": SCHEMA_URI,
        "title": "minispeed ds_config",
        "description": "DeepSpeed's ds_config.json as minispeed.engine reads it.",
        "type": "object",
        "properties": {**read, **unsupported},
        "additionalProperties": False,
    }


def _json(default: Any) -> str:
    """A default as it is written in the JSON file (`false`, not `False`); blank when none."""
    return "" if default is None else f"`{json.dumps(default)}`"


def _type_text(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return " / ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    if "anyOf" in prop:
        return 'integer / "auto"'
    kind = prop.get("type", "any")
    return " / ".join(kind) if isinstance(kind, list) else kind


def reference_markdown() -> str:
    """The config reference page: one table per section, from `config_schema()`."""
    schema = config_schema()
    lines = [
        "# Config reference",
        "",
        "Generated from the engine's JSON Schema by `python -m minispeed.engine.config reference`",
        "(a test keeps this page equal to its output). `python -m minispeed.engine.config schema`",
        "writes the schema itself, for editors.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    sections = []
    for key, prop in schema["properties"].items():
        default = prop.get("default")
        lines.append(
            f"| `{key}` | {_type_text(prop)} | {_json(default)} | {prop.get('description', '')} |"
        )
        if prop.get("properties"):
            sections.append((key, prop))
    for key, prop in sections:
        lines += ["", f"## `{key}`", "", prop["description"], ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for sub, sp in prop["properties"].items():
            default = sp.get("default")
            lines.append(
                f"| `{sub}` | {_type_text(sp)} | {_json(default)} | {sp.get('description', '')} |"
            )
    return "\n".join(lines) + "\n"
