"""Every rank passes `initialize` the same ds_config and the same model, checked before the first
collective that depends on them.

A script that builds its config per rank (a batch size from a per-node variable, a config file
that differs between machines) or its model per rank (a layer sized by the rank) does not fail
where the difference is: a different ZeRO stage or bucket size on one rank shows up as a
mismatched collective deep inside the set-up, and a different micro-batch size does not show up
at all, each rank averaging its gradients with a different weight. So `agree_on_inputs` runs on
every rank right after the process group exists: each rank hashes its config (flattened to the
user's dotted keys; the keys that may differ per rank, such as a monitor's output path, left out)
and its model's parameter list (name, full shape, dtype, trainable), the ranks exchange the
hashes, and when they differ every rank raises the same error, naming each key or parameter that
differs and each rank's value.

Cost: one `all_gather_object` of a 64-character digest per rank (two small all-gathers) at
`initialize`; the descriptions themselves travel only when the digests differ.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from torch import nn

import minispeed.comm as comm
from minispeed.core.config import ConfigError

# Top-level sections that may differ between ranks without changing what a rank computes or
# sends: where monitors, profilers and loggers write, and how often they print.
PER_RANK_SECTIONS = frozenset(
    {
        "tensorboard",
        "wandb",
        "csv_monitor",
        "comet",
        "aim",
        "flops_profiler",
        "comms_logger",
        "steps_per_print",
        "wall_clock_breakdown",
        "memory_breakdown",
        "dump_state",
    }
)
# Dotted keys that name a machine's own resources (a node's NVMe mount), and the asynchronous
# I/O tuning for them.
PER_RANK_KEYS = frozenset(
    {
        "aio",
        "zero_optimization.offload_param.nvme_path",
        "zero_optimization.offload_optimizer.nvme_path",
    }
)
_SHOWN = 6  # differing keys or parameters named in the error


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a.b": leaf}` of a nested mapping; a value JSON cannot carry is named by its type only
    (its `repr` may hold an address, which differs between processes)."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list | tuple):
        value = [
            v if isinstance(v, str | int | float | bool | type(None)) else f"<{type(v).__name__}>"
            for v in value
        ]
    elif not isinstance(value, str | int | float | bool | type(None)):
        value = f"<{type(value).__name__}>"
    return {prefix: value}


def config_entries(ds: Mapping[str, Any]) -> dict[str, Any]:
    """The config's dotted keys and values every rank must share."""
    return {
        k: v
        for k, v in _flat(ds).items()
        if k.split(".", 1)[0] not in PER_RANK_SECTIONS
        and not any(k == p or k.startswith(p + ".") for p in PER_RANK_KEYS)
    }


def model_entries(model: nn.Module) -> dict[str, Any]:
    """Per parameter name: full shape (a ZeRO-3 shard's `ds_shape`), dtype, trainable."""
    return {
        name: [_shape(p), str(p.dtype), p.requires_grad] for name, p in model.named_parameters()
    }


def _shape(p: nn.Parameter) -> Any:
    if isinstance(p, nn.parameter.UninitializedParameter):  # a lazy module before its forward
        return "uninitialized"
    return list(getattr(p, "ds_shape", p.shape))


def _differences(what: str, everyone: list[dict[str, Any]]) -> list[str]:
    keys = sorted(set().union(*everyone), key=str)
    out = []
    for k in keys:
        values = [d.get(k, "<absent>") for d in everyone]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            out.append(f"  {what} {k!r}: {per_rank}")
    return out


def agree_on_inputs(ds: Mapping[str, Any], model: nn.Module | None) -> None:
    """Raise on every rank when the ranks' configs (or models; `None`: not compared, as for a
    pipeline, whose ranks hold different stages) differ (module docstring)."""
    if comm.get_world_size() == 1:
        return
    mine = {"config": config_entries(ds), "model": model_entries(model) if model else {}}
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()
    if len(set(comm.all_gather_object(digest))) == 1:
        return
    everyone = comm.all_gather_object(mine)
    config = _differences("key", [e["config"] for e in everyone])
    params = _differences("parameter", [e["model"] for e in everyone])
    lines = []
    if config:
        lines += ["the ranks were given different ds_configs:", *config[:_SHOWN]]
        lines += [f"  ... and {len(config) - _SHOWN} more"] if len(config) > _SHOWN else []
    if params:
        lines += ["the ranks' models differ (name: [shape, dtype, trainable]):", *params[:_SHOWN]]
        lines += [f"  ... and {len(params) - _SHOWN} more"] if len(params) > _SHOWN else []
    lines.append(
        "every rank must pass initialize() the same config and build the same model; only the "
        "monitors' sections (" + ", ".join(sorted(PER_RANK_SECTIONS)) + "), the NVMe paths and "
        "aio may differ"
    )
    raise ConfigError("", "\n".join(lines))
