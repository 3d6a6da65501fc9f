"""`minispeed report --config`: the config the engine would resolve, key by key, each with its
source.

- **given**: the file sets it (and not to `"auto"`);
- **derived**: the engine computed it from other keys: the batch triple's missing members
  (`train_batch_size = micro × accumulation × data-parallel size`), or a default that depends
  on other keys (stage 2's `overlap_comm`, the precision's dtypes);
- **default**: left out, and the engine uses its documented default (the JSON Schema's, which
  `minispeed config reference` prints).

Every key the engine reads is listed (top-level keys and one level inside each section);
DeepSpeed keys minispeed accepts only at their default are left out. Cost: one config
resolution, no process group.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from minispeed.engine.config import BATCH_KEYS, EngineConfig

__all__ = ["resolved_rows", "resolved_table"]

_OFF = "(off)"


def resolved_rows(cfg: EngineConfig) -> list[tuple[str, Any, str]]:
    """`(dotted key, value, source)` for every key the engine reads (see the module docstring)."""
    from minispeed.engine.config.schema import config_schema

    raw, rows = cfg.raw, []
    props = config_schema()["properties"]
    zero_fields = cfg.zero.ds_key_fields()
    batch = dict(zip(BATCH_KEYS, (cfg.train_batch_size, cfg.micro_batch_size,
                                  cfg.gradient_accumulation_steps), strict=True))  # fmt: skip
    for key, spec in props.items():
        if spec.get("description", "").startswith("Not supported"):
            continue
        if key in batch:
            given = raw.get(key) not in (None, "auto")
            rows.append((key, batch[key], "given" if given else "derived"))
            continue
        inner = spec.get("properties") or {}
        if key == "zero_optimization":
            section = raw.get(key) or {}
            for sub, sub_spec in inner.items():
                if sub in section:
                    rows.append((f"{key}.{sub}", section[sub], "given"))
                    continue
                value = _zero_value(cfg, sub, zero_fields)
                static = sub_spec.get("default", _field_default(cfg.zero, zero_fields.get(sub)))
                source = "default" if static is None or value == static else "derived"
                rows.append((f"{key}.{sub}", value, source))
        elif inner and key not in ("optimizer", "scheduler"):
            section = raw.get(key)
            if section is None:
                rows.append((key, _OFF, "default"))
                continue
            for sub, sub_spec in inner.items():
                if sub in section:
                    rows.append((f"{key}.{sub}", section[sub], "given"))
                else:
                    rows.append((f"{key}.{sub}", sub_spec.get("default", "-"), "default"))
        elif key in raw:
            rows.append((key, raw[key], "given"))
        else:
            rows.append((key, spec.get("default", _OFF if inner else "-"), "default"))
    for name, dtype in (("param_dtype", cfg.precision.param_dtype),
                        ("grad_accum_dtype", cfg.precision.grad_accum_dtype)):  # fmt: skip
        rows.append((f"(precision).{name}", str(dtype).removeprefix("torch."), "derived"))
    return rows


def _field_default(obj: Any, name: str | None) -> Any:
    """The dataclass field's declared default (None when it has none)."""
    for f in dataclasses.fields(obj):
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
    return None


def _zero_value(cfg: EngineConfig, ds_key: str, fields: dict[str, str]) -> Any:
    if ds_key in fields:
        return getattr(cfg.zero, fields[ds_key])
    if ds_key in ("offload_optimizer", "offload_param"):
        section = getattr(cfg.zero, ds_key, None)
        return "none" if section is None else getattr(section, "device", section)
    names = {f.name for f in dataclasses.fields(cfg.zero)}
    return getattr(cfg.zero, ds_key) if ds_key in names else "-"


def resolved_table(cfg: EngineConfig, title: str) -> Any:
    """The rows as a rich table."""
    from rich.table import Table

    table = Table(title=title, caption="given: in the file; derived: computed; default: left out")
    table.add_column("key", overflow="fold")
    table.add_column("value", overflow="fold")
    table.add_column("source")
    colour = {"given": "green", "derived": "cyan", "default": "dim"}
    for key, value, source in resolved_rows(cfg):
        shown = value if isinstance(value, str) else json.dumps(value)
        table.add_row(key, shown, f"[{colour[source]}]{source}[/]")
    return table
