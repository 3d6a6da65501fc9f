"""Choosing a class by its ds_config name: the `optimizer` and `scheduler` sections.

Both share one shape, `{"type": NAME, "params": {...}}`, read once by `ByName` (the config
pattern, `minispeed.core.sections`), and one failure mode worth a clear error: a misspelled type
or key would otherwise be a `TypeError` deep inside a constructor, or (for keys DeepSpeed pops
and defaults) be ignored, and a constructor's own check (torch's "Invalid learning rate: -1")
would name no key. Every error here is a `ConfigError` (a `ValueError`) whose path is the key as
written (`optimizer.params.lr`), naming the value, the nearest accepted name
(`minispeed.core.config.did_you_mean`) and the fix. Cost: one edit distance per (key, accepted
name), on error only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from minispeed.core import config as core_config
from minispeed.core.config import ConfigError, check_keys, join_path
from minispeed.core.sections import Section, Unsupported, build, ds_only, key, translate_section

__all__ = [
    "ByName",
    "OptimizerSection",
    "SchedulerSection",
    "check_params",
    "construct",
    "did_you_mean",
]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """`" (did you mean 'x' for 'word'?)"` for the nearest of `choices` (case-insensitive edit
    distance, core's rule), else `""`."""
    return core_config.did_you_mean([word], choices)


def _params(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"must be a JSON object of keyword arguments, got {value!r} ({type(value).__name__})"
        )
    return dict(value)


@dataclass(frozen=True)
class ByName(Section):
    """A class chosen by name, with its keyword arguments: `{"type": ..., "params": {...}}`."""

    example: ClassVar[str] = ""

    type: str = key("type")
    """The class's DeepSpeed name (a torch class name is accepted too)."""
    params: dict[str, Any] = key("params", default_factory=dict, read=_params)
    """Its keyword arguments, checked against what the chosen class takes."""

    @classmethod
    def from_section(
        cls, section: Mapping[str, Any] | None = None, *, path: str | None = None, **context: Any
    ) -> Any:
        """The section (a dict as written); `type` is required, and a param left at the Hugging
        Face Trainer's placeholder `"auto"` is refused naming who fills it in."""
        path = cls.ds_path if path is None else path
        kwargs = translate_section(cls, section, path)
        if not kwargs.get("type"):
            raise ConfigError(
                join_path(path, "type"),
                f"needs a 'type' string: give the {path} by name, e.g. {cls.example!r}",
            )
        # Hugging Face's Trainer replaces "auto" before DeepSpeed sees the config (DeepSpeed
        # itself then fails with a TypeError inside the constructor); name the key instead.
        auto = sorted(k for k, v in kwargs.get("params", {}).items() if v == "auto")
        if auto:
            raise ConfigError(
                f"{path}.params.{auto[0]}",
                'is "auto", a placeholder the Hugging Face Trainer fills in; outside the Trainer '
                'give its value (minispeed resolves "auto" only in the batch sizes)',
            )
        return build(cls, path, {**kwargs, **context}, section)


@dataclass(frozen=True)
class OptimizerSection(ByName):
    """The optimizer by name (DeepSpeed section `optimizer`), built by `engine.optim`."""

    ds_path: ClassVar[str] = "optimizer"
    example: ClassVar[str] = "AdamW"
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "legacy_fusion": ds_only(
            False, "minispeed has no legacy fused-Adam fp16 path (DeepSpeed's null means false)"
        ),
    }


@dataclass(frozen=True)
class SchedulerSection(ByName):
    """The learning-rate schedule by name (DeepSpeed section `scheduler`), built by
    `engine.lr_schedules`."""

    ds_path: ClassVar[str] = "scheduler"
    example: ClassVar[str] = "WarmupLR"


def check_params(params: Mapping[str, Any], accepted: Iterable[str], path: str, kind: str) -> None:
    """Refuse the first key of `params` not in `accepted` (core's `check_keys`, at
    `<path>.params`), naming what `kind` takes."""
    try:
        check_keys(params, accepted, f"{path}.params", known_as=f"{kind} takes")
    except ConfigError as e:  # name the param in the words too: "unknown param 'momentun'"
        name = e.path.rsplit(".", 1)[-1]
        reason = e.reason.replace("unknown key", f"unknown param {name!r}", 1)
        raise ConfigError(e.path, reason) from None


# torch's constructor messages name the value, not the argument ("Invalid learning rate: -1").
_PHRASES = {
    "learning rate": "lr",
    "epsilon": "eps",
    "beta parameter": "betas",
    "momentum": "momentum",
    "weight_decay": "weight_decay",
    "lr_decay": "lr_decay",
    "initial_accumulator_value": "initial_accumulator_value",
}


def _culprit(message: str, params: Mapping[str, Any]) -> str | None:
    """The param a constructor's error message is about: one it names as a word, else the
    one torch's phrase stands for."""
    for name in params:
        if re.search(rf"\b{re.escape(str(name))}\b", message):
            return name
    lowered = message.lower()
    for phrase, name in _PHRASES.items():
        if phrase in lowered and name in params:
            return name
    return None


def construct(cls: type, first: Any, params: Mapping[str, Any], path: str) -> Any:
    """`cls(first, **params)`; a `ValueError` of the constructor's own check becomes a
    `ConfigError` at the param it is about (`optimizer.params.lr`), with its value, the
    class's words and the fix."""
    try:
        return cls(first, **params)
    except ConfigError:
        raise
    except ValueError as e:
        name = _culprit(str(e), params)
        if name is None:
            raise ConfigError(
                f"{path}.params",
                f"refused by {cls.__module__}.{cls.__name__}: {e}; fix the value it names",
            ) from e
        raise ConfigError(
            f"{path}.params.{name}",
            f"{params[name]!r} is refused by {cls.__module__}.{cls.__name__} ({e}); give a "
            f"value it accepts",
        ) from e
