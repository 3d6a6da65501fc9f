"""A JSON Schema of the whole ds_config, and the config reference page rendered from it.

```bash
minispeed config schema --out ds_config.schema.json   # editors complete keys and flag typos
minispeed config reference --out docs/engine/config-reference.md
```

Both are generated from the dataclasses the checks read (`EngineConfig` and each package's
section, `minispeed.core.sections.section_schema`): a key listed is one a package accepts, with
the type its field holds, the description its owner wrote under the field and the default the
code applies; every section and nested section (`zero_optimization.offload_optimizer`) is an
object with `additionalProperties: false`, so an editor flags a misspelled key at any depth.
The optimizer's and scheduler's `params` depend on the type chosen and are checked when it is
built (`engine.optim`, `engine.lr_schedules`).
"""

from __future__ import annotations

import json
from typing import Any

from minispeed.core.sections import is_alias, is_unsupported, section_schema
from minispeed.engine.config import EngineConfig

__all__ = ["config_schema", "reference_markdown"]

SCHEMA_URI = "https://json-schema.org/draft/2020-12/schema"


def config_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of every ds_config key the engine accepts."""
    return {
        "$schema": SCHEMA_URI,
        "title": "minispeed ds_config",
        **section_schema(
            EngineConfig, description="DeepSpeed's ds_config.json as minispeed.engine reads it."
        ),
    }


def _json(prop: dict[str, Any]) -> str:
    """A default as it is written in the JSON file (`false`, not `False`); blank when none."""
    return f"`{json.dumps(prop['default'])}`" if "default" in prop else ""


def _type_text(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return " / ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    if "anyOf" in prop:
        return " / ".join(
            json.dumps(p["const"]) if "const" in p else str(p.get("type")) for p in prop["anyOf"]
        )
    kind = prop.get("type", "any")
    return " / ".join(kind) if isinstance(kind, list) else kind


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(props: dict[str, Any]) -> list[str]:
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, prop in props.items():
        lines.append(
            f"| `{key}` | {_cell(_type_text(prop))} | {_cell(_json(prop))} | "
            f"{_cell(prop.get('description', ''))} |"
        )
    return lines


def _sections(path: str, prop: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every (nested) section under `prop`, with its dotted path, outermost first."""
    out = []
    for key, sub in prop.get("properties", {}).items():
        if sub.get("properties") and not is_alias(sub):
            where = f"{path}.{key}" if path else key
            out += [(where, sub), *_sections(where, sub)]
    return out


def reference_markdown() -> str:
    """The config reference page: the top-level keys, then one table per section (nested
    sections at their full key path), from `config_schema()`."""
    schema = config_schema()
    lines = [
        "# Config reference",
        "",
        "Generated from the engine's config dataclasses by `minispeed config reference`",
        '(a test keeps this page equal to its output; docs/architecture.md, "The config',
        'pattern", says how a key is added). `minispeed config schema` writes the JSON Schema',
        "itself, for editors. Each default is the one the code applies when the key is left out.",
        "",
        "## Top level",
        "",
        *_table({k: v for k, v in schema["properties"].items() if not is_unsupported(v)}),
        "",
        "DeepSpeed's keys minispeed does not implement (each accepted at DeepSpeed's default, so",
        "a config written out in full loads, or refused):",
        "",
        *_table({k: v for k, v in schema["properties"].items() if is_unsupported(v)}),
    ]
    for path, prop in _sections("", schema):
        lines += ["", f"## `{path}`", "", prop["description"], "", *_table(prop["properties"])]
    return "\n".join(lines) + "\n"
