"""Choosing a class by its ds_config name: the section's shape, the type, the param keys.

The `"optimizer"` and `"scheduler"` sections share one shape, `{"type": NAME, "params": {...}}`,
and one failure mode worth a clear error: a misspelled type or key would otherwise be a
`TypeError` deep inside a constructor, or (for keys DeepSpeed pops and defaults) be ignored.
Every error here is a `ConfigError` (a `ValueError`) carrying the key path, naming the section,
the key, the nearest accepted name (`minispeed.core.config.did_you_mean`) and the accepted names.
Cost: one edit distance per (key, accepted name), on error only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from minispeed.core import config as core_config
from minispeed.core.config import ConfigError

__all__ = ["check_keys", "did_you_mean", "split_section"]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`" (did you mean 'x' for 'word'?)"` for the nearest of `choices` (case-insensitive edit
    distance, core's rule), else `""`."""
    return core_config.did_you_mean([word], choices)


def split_section(section: Any, name: str) -> tuple[str, dict[str, Any]]:
    """`(type, params)` of a ds_config `name` section (`"optimizer"` or `"scheduler"`)."""
    if not isinstance(section, Mapping):
        raise ValueError(
            f'ds_config {name!r} must be an object like {{"type": ..., "params": {{...}}}}, '
            f"got {type(section).__name__}"
        )
    unknown = sorted(set(section) - {"type", "params"})
    if unknown:
        raise ValueError(
            f"ds_config {name!r} has unknown key {unknown[0]!r}"
            f"{did_you_mean(unknown[0], ['type', 'params'])}: it takes only 'type' and 'params'"
        )
    kind = section.get("type")
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"ds_config {name!r} needs a 'type' string, got {kind!r}")
    params = section.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValueError(
            f"ds_config {name}.params must be an object of keyword arguments, got "
            f"{type(params).__name__}"
        )
    # Hugging Face's Trainer replaces "auto" before DeepSpeed sees the config (DeepSpeed itself
    # then fails with a TypeError inside the constructor); name the key instead.
    auto = sorted(k for k, v in params.items() if isinstance(v, str) and v == "auto")
    if auto:
        raise ConfigError(
            f"{name}.params.{auto[0]}",
            'is "auto", a placeholder the Hugging Face Trainer fills in; outside the Trainer '
            'give its value (minispeed resolves "auto" only in the batch sizes)',
        )
    return kind, dict(params)


def check_keys(where: str, params: Mapping[str, Any], accepted: Iterable[str]) -> None:
    """Raise a `ConfigError` for the first key of `params` not in `accepted`. `where` names the
    section and type as `"ds_config <section> <type>"` (e.g. `"ds_config scheduler WarmupLR"`);
    the error's path is `<section>.params.<key>`."""
    accepted = sorted(accepted)
    section = where.split()[1] if where.startswith("ds_config ") else where
    for key in params:
        if key not in accepted:
            raise ConfigError(
                f"{section}.params.{key}",
                f"{where}: unknown param {key!r}{did_you_mean(key, accepted)}; it accepts "
                f"{', '.join(accepted)}",
            )
