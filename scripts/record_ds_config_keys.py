"""Record every ds_config key DeepSpeed 0.19.8 accepts, at every depth, as a JSON test fixture.

Runs only in the DeepSpeed reference venv, never with minispeed importable:

    env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python scripts/record_ds_config_keys.py

It writes `tests/engine/fixtures/ds_config_keys.json`, which
`tests/engine/test_engine_ds_keys.py` holds minispeed's config schema against: every key listed
here is read by minispeed, refused by name, or listed in the test with the reason it is left
out; every key minispeed reads is listed here or declared ours there; shared keys' defaults are
equal unless listed. Recording twice gives the same file.

DeepSpeed reads its config two ways, and the walk follows both:

- **pydantic sections** (`DeepSpeedConfigModel`: `zero_optimization` and its offload sections,
  `fp16`, `bf16`, `comms_logger`, the monitors, `compile`, `tensor_parallel`, `hybrid_engine`,
  `timers.throughput`, `weight_quantization`, ...) refuse keys they do not declare
  (`extra="forbid"`); their keys are the models' fields, under their names and their aliases
  (`populate_by_name=True` takes both), deprecated fields included, nested models walked.
  Which model reads a section is found, not listed: the section is given one key no model
  declares, and the validation error DeepSpeed raises names the model (its `title`) and where
  the key sat in it (`loc`).
- **dict sections** (the top level, `activation_checkpointing`, `flops_profiler`, `aio`,
  `checkpoint`, `data_types`, `autotuning`, `data_efficiency`, ...) are read with `get`,
  `[]` and `in`, and ignore what they do not read; their keys are the ones `DeepSpeedConfig`
  looks up, recorded by giving it a dict that logs every lookup. A key looked up is then given
  a logging dict of its own (empty, then `{"enabled": true}`, since some sections read their
  keys only when on): when DeepSpeed looks inside, it is a section, walked the same way.

Beyond `DeepSpeedConfig`, `deepspeed.initialize` reads `sequence_parallel_size` and
`data_parallel_size` from the top level, and the pipeline engine reads keys of `pipeline`
(a section `get_pipeline_config` copies whole): both are read from their source files below.
`optimizer.params` and `scheduler.params` are open (the keyword arguments of the class named
by `type`). Keys DeepSpeed 0.19.8 refuses as removed features (`_REMOVED_TOP_LEVEL_CONFIG_KEYS`,
`_REMOVED_ZERO_CONFIG_KEYS`) are recorded apart, with DeepSpeed's message.
"""

from __future__ import annotations

import copy
import enum
import inspect
import json
import os
import re
import typing
from pathlib import Path
from typing import Any

import deepspeed
import pydantic
import torch
from deepspeed.runtime import config as ds_config
from deepspeed.runtime.config_utils import DeepSpeedConfigModel

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_config_keys.json"
BASE = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1}
SENTINEL = "__record_ds_config_keys__"  # a key no DeepSpeed model declares
OPEN = {"optimizer.params", "scheduler.params"}  # the named class's keyword arguments
MAX_DEPTH = 4


# -- the logging dict ----------------------------------------------------------------------------
class Log:
    """What DeepSpeed looked up, by section path: `{path: {key: default or None}}`, and the
    paths it iterated whole (`items()`, a copy)."""

    def __init__(self) -> None:
        self.looked: dict[str, dict[str, Any]] = {}
        self.iterated: set[str] = set()

    def saw(self, path: str, key: Any, default: Any = None) -> None:
        if isinstance(key, str):
            self.looked.setdefault(path, {}).setdefault(key, default)


class _Keys:
    """`probe.keys()`: `in` logs the key."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def __contains__(self, key: Any) -> bool:
        self.probe.log.saw(self.probe.path, key)
        return dict.__contains__(self.probe, key)

    def __iter__(self) -> Any:
        self.probe.log.iterated.add(self.probe.path)
        return iter(dict.keys(self.probe))

    def __len__(self) -> int:
        return dict.__len__(self.probe)


class Probe(dict):
    """A dict that logs every key looked up in it; a missing key looked up with a dict default
    answers a `Probe` of that default, so the lookups below it are logged too."""

    def __init__(self, data: dict, path: str, log: Log) -> None:
        super().__init__(data)
        self.path, self.log = path, log

    def _sub(self, key: str, value: Any) -> Any:
        if isinstance(value, dict) and not isinstance(value, Probe):
            return Probe(value, f"{self.path}.{key}" if self.path else key, self.log)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        self.log.saw(self.path, key, default)
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        return self._sub(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.log.saw(self.path, key)
        return dict.__getitem__(self, key)

    def __contains__(self, key: Any) -> bool:
        self.log.saw(self.path, key)
        return dict.__contains__(self, key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.log.saw(self.path, key, default)
        return dict.setdefault(self, key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self.log.saw(self.path, key, default[0] if default else None)
        return dict.pop(self, key, *default)

    def keys(self) -> Any:
        return _Keys(self)

    def items(self) -> Any:
        self.log.iterated.add(self.path)
        return dict.items(self)

    def __iter__(self) -> Any:
        self.log.iterated.add(self.path)
        return dict.__iter__(self)

    def __copy__(self) -> Probe:  # DeepSpeedConfig copies the dict it is given
        return self


def _probe_tree(value: Any, path: str, log: Log) -> Any:
    if isinstance(value, dict):
        return Probe(
            {k: _probe_tree(v, f"{path}.{k}" if path else k, log) for k, v in value.items()},
            path,
            log,
        )
    return value


def run(config: dict) -> tuple[Log, BaseException | None]:
    """Build `DeepSpeedConfig` from `config` (every dict in it logging); what it looked up, and
    the error it raised, if any."""
    log = Log()
    try:
        ds_config.DeepSpeedConfig(_probe_tree(copy.deepcopy(config), "", log))
    except Exception as e:  # a probe value is often of the wrong type: what it read still counts
        return log, e
    return log, None


def _set(config: dict, path: str, value: Any) -> dict:
    config = copy.deepcopy(config)
    node = config
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            return config
    node[last] = value
    return config


# -- pydantic models -----------------------------------------------------------------------------
def _models(annotation: Any) -> list[type]:
    """The DeepSpeedConfigModel classes an annotation holds (`Optional[X]`, `X | None`, ...)."""
    if inspect.isclass(annotation) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, pydantic.BaseModel):
        value = value.model_dump()
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def _default(field: Any) -> Any:
    if field.default_factory is not None:
        try:
            return _jsonable(field.default_factory())
        except TypeError:  # a factory that takes the validated data
            return None
    from pydantic_core import PydanticUndefined

    return None if field.default is PydanticUndefined else _jsonable(field.default)


def walk_model(cls: type, path: str, out: dict[str, dict]) -> None:
    """Every key the pydantic model `cls` accepts at `path`, nested models walked."""
    for name, field in cls.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        names = [name]
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str) and alias not in names:
                names.append(alias)
            elif isinstance(alias, pydantic.AliasChoices):
                names += [a for a in alias.choices if isinstance(a, str) and a not in names]
        subs = _models(field.annotation)
        entry: dict[str, Any] = {
            "kind": "section" if subs else "key",
            "reader": f"{cls.__module__}:{cls.__qualname__}.{name}",
            "default": _default(field),
        }
        if extra.get("deprecated"):
            entry["deprecated"] = extra.get("new_param") or True
        for key in names:
            where = f"{path}.{key}"
            out[where] = dict(entry)
            for sub in subs:
                walk_model(sub, where, out)


def _model_at(error: pydantic.ValidationError, classes: dict[str, type]) -> tuple[type, tuple]:
    """The model that refused the sentinel, and the field path inside it to where it sat."""
    for detail in error.errors():
        loc = tuple(detail["loc"])
        if detail["type"] == "extra_forbidden" and loc and loc[-1] == SENTINEL:
            cls = classes[error.title]
            for key in loc[:-1]:
                field = next(
                    f
                    for n, f in cls.model_fields.items()
                    if key in (n, f.alias, f.validation_alias)
                )
                (cls,) = _models(field.annotation)
            return cls, loc[:-1]
    raise LookupError


def _all_models() -> dict[str, type]:
    found: dict[str, type] = {}
    todo = [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("deepspeed."):
                found.setdefault(sub.__name__, sub)
    return found


# -- the walk ------------------------------------------------------------------------------------
def record() -> dict[str, Any]:
    """`{"keys": {path: entry}, "removed": {path: DeepSpeed's message}, "open": [...]}`."""
    classes = _all_models()
    keys: dict[str, dict] = {}
    log, error = run(BASE)
    assert error is None, error
    for key, default in log.looked[""].items():
        keys[key] = {"kind": "key", "reader": "deepspeed.runtime.config:DeepSpeedConfig",
                     "default": _jsonable(default)}  # fmt: skip
    _nested(log, keys)
    frontier = sorted(keys)
    for _ in range(MAX_DEPTH):
        found = []
        for path in frontier:
            found += _probe_section(path, keys, classes)
        frontier = found
    for path in OPEN:  # read only with a `type`, which the probe does not give
        keys[path] = {"kind": "open", "reader": "deepspeed.runtime.config:DeepSpeedConfig",
                      "default": None}  # fmt: skip
    for key in _initialize_reads():
        keys.setdefault(key, {"kind": "key", "reader": "deepspeed:initialize", "default": None})
    for key, default in _pipeline_reads().items():
        keys[f"pipeline.{key}"] = {"kind": "key", "reader": "deepspeed.runtime.pipe.engine",
                                   "default": default}  # fmt: skip
    keys["pipeline"]["kind"] = "section"
    removed = {k: v for k, v in ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS.items()}
    removed |= {f"zero_optimization.{k}": v for k, v in ds_config._REMOVED_ZERO_CONFIG_KEYS.items()}
    for path in removed:
        keys.pop(path, None)
    return {"keys": dict(sorted(keys.items())), "removed": removed}


def _nested(log: Log, keys: dict[str, dict], placed: str = "") -> list[str]:
    """Record the lookups below the top level (dict sections read through a dict default),
    except `placed`, a key the probe put there itself (a model's `**section` reads every key
    present)."""
    new = []
    for section, looked in log.looked.items():
        if not section:
            continue
        keys.setdefault(section, {"kind": "section", "reader": "dict", "default": None})
        keys[section]["kind"] = "section"
        for key, default in looked.items():
            where = f"{section}.{key}"
            if key == SENTINEL or where in keys or where == placed:
                continue
            keys[where] = {"kind": "key", "reader": "dict", "default": _jsonable(default)}
            new.append(where)
    return new


def _probe_section(path: str, keys: dict[str, dict], classes: dict[str, type]) -> list[str]:
    """Give `path` a logging dict (empty, then enabled) holding the sentinel: a model that
    refuses the sentinel reads it, lookups inside it show a dict section. Returns new paths."""
    new: list[str] = []
    for value in ({SENTINEL: 1}, {"enabled": True, SENTINEL: 1}):
        log, error = run(_set(BASE, path, value))
        # "enabled" counts when looked up while absent (the first run), not when read because
        # the probe put it there
        new += _nested(log, keys, placed=f"{path}.enabled")
        if isinstance(error, pydantic.ValidationError):
            try:
                cls, inner = _model_at(error, classes)
            except LookupError:
                continue
            if inner and not path.endswith(".".join(map(str, inner))):
                continue
            keys[path]["kind"] = "section"
            keys[path]["reader"] = f"{cls.__module__}:{cls.__qualname__}"
            before = set(keys)
            walk_model(cls, path, keys)
            new += sorted(set(keys) - before)
    return new


def _initialize_reads() -> list[str]:
    """Top-level keys `deepspeed.initialize` reads itself: `"<key>" in config`."""
    source = inspect.getsource(deepspeed.initialize)
    return sorted(set(re.findall(r'"(\w+)" in config\b', source)))


def _pipeline_reads() -> dict[str, Any]:
    """`pipeline` keys: `get_pipeline_config`'s defaults and what the pipeline engine reads."""
    from deepspeed.runtime.pipe import engine as pipe_engine

    found: dict[str, Any] = dict(ds_config.get_pipeline_config({}))
    source = inspect.getsource(pipe_engine)
    for key in re.findall(r"\.pipeline(?:\[|\.get\()'(\w+)'", source):
        found.setdefault(key, None)
    return found


if __name__ == "__main__":
    result = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "pydantic": pydantic.VERSION,
        "command": "env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python "
        "scripts/record_ds_config_keys.py",
        **record(),
    }
    out = Path(os.environ.get("FIXTURE_OUT", FIXTURE))
    tmp = out.with_suffix(".json.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(result, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    print(f"{out}: {len(result['keys'])} keys, {len(result['removed'])} removed")
