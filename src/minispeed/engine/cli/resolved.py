"""`minispeed report --config`: the config the engine would resolve, key by key, each with its
source.

- **given**: the file sets it (and not to `"auto"`);
- **derived**: the engine computed it from other keys: the batch triple's missing members
  (`train_batch_size = micro × accumulation × data-parallel size`), or a default that depends
  on other keys (stage 2's `overlap_comm`, the precision's dtypes);
- **default**: left out, and the engine uses its documented default (the JSON Schema's, which
  `minispeed config reference` prints).

Every key the engine reads is listed, at its full path (`zero_optimization.offload_optimizer.
device`), generated from the same dataclasses as the schema (`minispeed.core.sections.
section_rows`); DeepSpeed keys minispeed accepts only at their default are left out. Cost: one
config resolution, no process group.
"""

from __future__ import annotations

import json
from typing import Any

from minispeed.core.sections import section_rows
from minispeed.engine.config import EngineConfig

__all__ = ["resolved_rows", "resolved_table"]


def resolved_rows(cfg: EngineConfig) -> list[tuple[str, Any, str]]:
    """`(dotted key, value, source)` for every key the engine reads (see the module docstring)."""
    rows = section_rows(EngineConfig, cfg, cfg.raw, "")
    for name, dtype in (("param_dtype", cfg.precision.param_dtype),
                        ("grad_accum_dtype", cfg.precision.grad_accum_dtype)):  # fmt: skip
        rows.append((f"(precision).{name}", str(dtype).removeprefix("torch."), "derived"))
    return rows


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
