"""The config pattern: one ds_config section is one frozen dataclass, owned by its package,
whose fields declare the DeepSpeed keys they read (docs/architecture.md, "The config pattern").

```python
@dataclass(frozen=True)
class FlopsProfilerConfig(Section):
    ds_path: ClassVar[str] = "flops_profiler"   # where the section sits in a ds_config

    enabled: bool = key("enabled", False)
    \"\"\"Profile one step.\"\"\"
    module_depth: int = key("module_depth", -1)
    \"\"\"Levels of the module tree printed (-1: all).\"\"\"

cfg = FlopsProfilerConfig.from_section({"enabled": True})
```

Everything else comes from those fields, so adding a key is one field in one file:

- **reading** (`read_section`): unknown keys refused with a did-you-mean (`check_keys`), older
  names (`aliases`) renamed, DeepSpeed's integral floats (`5e8`) made ints, a key's own
  conversion (`read`) applied, a nested section (`section`) read by its own class at its own
  path (`zero_optimization.offload_optimizer`), the value's type checked against the field's;
- **errors that name the key the user wrote**: a field's check in `__post_init__` raises
  `field_error(self, "reduce_bucket_numel", "must be >= 1, got -5")`; built from a section, the
  reader renames it `zero_optimization.reduce_bucket_size: must be >= 1, got -5
  (ZeroConfig.reduce_bucket_numel)`;
- **the JSON Schema** (`section_schema`): each key's JSON type from the field's annotation, its
  description from the field's docstring, its default from the field's default, nested
  sections as nested objects, and `additionalProperties: false` at every level;
- **`minispeed report --config`** (`section_rows`): each key's value and whether it was given,
  left at its default, or derived.

DeepSpeed keys a section does not implement sit in one class variable, `ds_unsupported`: key ->
`ds_only(value, why)` (accepted at that value only, DeepSpeed's default, where it changes
nothing) or `ds_refused(why)` (refused at every value); `why` says what to use instead. The
reader refuses them by name (`check_keys`), the schema lists them with the value accepted as
their default, and the adapters of DeepSpeed's config models report that value. A key that
sets no one field (offload's `pipeline`, which sets both `pipeline_read` and `pipeline_write`)
is declared in `ds_extra` (key -> its JSON Schema) and read by the class's own `from_section`.

Cost: one pass over the fields per section read; the docstrings are parsed (`ast`) only for
the schema.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import itertools
import json
import textwrap
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from minispeed.core.config import (
    ConfigError,
    ConfigTypeError,
    Unsupported,
    check_keys,
    field_error,
    join_path,
)

__all__ = [
    "Key",
    "Section",
    "Unsupported",
    "build",
    "check_type",
    "check_types",
    "ds_keys",
    "ds_only",
    "ds_refused",
    "field_docs",
    "is_alias",
    "is_unsupported",
    "key",
    "key_schema",
    "read_section",
    "section_rows",
    "section_schema",
    "translate_section",
    "unsupported_keys",
]

_META = "minispeed.ds_key"
_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclasses.dataclass(frozen=True)
class Key:
    """How one DeepSpeed key of a section reaches a dataclass field (see `key`)."""

    name: str
    """The DeepSpeed key inside the section (`"reduce_bucket_size"`)."""
    aliases: tuple[str, ...] = ()
    """Older DeepSpeed names of the same key, accepted and renamed."""
    read: Callable[[Any], Any] | None = None
    """DeepSpeed's value -> the field's (`"best"` -> `"parameters"`); raises `ValueError` or
    `TypeError` with the reason for a value it cannot take. None: the value as written."""
    section: type | str | None = None
    """A nested section: its class, or `"module:Class"` for a package imported only when needed
    (offload inside zero). Its value is read by that class's `from_section` at the nested path."""
    schema: Mapping[str, Any] = dataclasses.field(default_factory=lambda: _EMPTY)
    """JSON Schema entries overriding what the field says (an `enum`; the DeepSpeed-side type
    and default of a key with a `read`)."""
    derived: str = ""
    """For a default that depends on other keys: what it is, in words (no static default then)."""


def key(
    name: str,
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    aliases: tuple[str, ...] = (),
    read: Callable[[Any], Any] | None = None,
    section: type | str | None = None,
    schema: Mapping[str, Any] | None = None,
    derived: str = "",
) -> Any:
    """A dataclass field read from the DeepSpeed key `name` of its section (`Key`'s fields)."""
    meta = Key(name, tuple(aliases), read, section, MappingProxyType(dict(schema or {})), derived)
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={_META: meta}
    )


def ds_only(value: Any, why: str, *, also: tuple[Any, ...] = ()) -> Unsupported:
    """A DeepSpeed key a section does not implement, accepted at `value` only (DeepSpeed's
    default, where the key changes nothing) and at the values `also` names (each meaning what
    minispeed does); `why`: the reason and what to use instead."""
    return Unsupported(why, value, tuple(also))


def ds_refused(why: str) -> Unsupported:
    """A DeepSpeed key a section does not implement, refused at every value (no value of it
    means what minispeed does); `why`: the reason and what to use instead."""
    return Unsupported(why)


def unsupported_keys(cls: type) -> Mapping[str, Unsupported]:
    """`{DeepSpeed key: Unsupported}` of a section class (its `ds_unsupported`; none: empty)."""
    return getattr(cls, "ds_unsupported", None) or _EMPTY


def ds_keys(cls: type) -> dict[str, tuple[dataclasses.Field, Key]]:
    """`{DeepSpeed key: (field, Key)}` of a section class, in field order."""
    return {
        f.metadata[_META].name: (f, f.metadata[_META])
        for f in dataclasses.fields(cls)
        if _META in f.metadata
    }


def _section_class(ref: type | str) -> type:
    if isinstance(ref, type):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


# -- the type check ------------------------------------------------------------------------------
_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "bool": (bool,),
    "float": (int, float),
    "str": (str,),
    "None": (type(None),),
    "dict": (dict,),
    "Mapping": (Mapping,),
    "list": (list,),
    "tuple": (tuple,),
}
_JSON: dict[str, str] = {
    "int": "integer",
    "bool": "boolean",
    "float": "number",
    "str": "string",
    "None": "null",
    "dict": "object",
    "Mapping": "object",
    "list": "array",
    "tuple": "array",
}


def _parts(annotation: Any) -> list[str]:
    """`"int | None"` -> `["int", "None"]`; `"dict[str, Any]"` -> `["dict"]`."""
    return [p.strip().split("[")[0] for p in str(annotation).split("|")]


def _allowed(annotation: Any) -> tuple[type, ...] | None:
    """The Python types a field of this annotation holds; None when the annotation names a
    class or `Any` (that field's owner checks it)."""
    parts = _parts(annotation)
    if any(p not in _TYPES for p in parts):
        return None
    return tuple(t for p in parts for t in _TYPES[p])


def check_type(annotation: Any, value: Any) -> str | None:
    """Why `value` cannot be held by a field annotated `annotation` (`"int | None"`), or None.
    `bool` is an `int` subclass, but a flag is not a number: `True` is refused where a number is
    meant, `1` where a flag is."""
    allowed = _allowed(annotation)
    if allowed is None:
        return None
    ok = isinstance(value, allowed) and (not isinstance(value, bool) or bool in allowed)
    if ok:
        return None
    kinds = " or ".join(_WORDS.get(p, p) for p in _parts(annotation))
    return f"must be {kinds}, got {value!r} ({type(value).__name__})"


_WORDS = {
    "int": "an integer",
    "bool": "true or false",
    "float": "a number",
    "str": "a string",
    "None": "null",
    "dict": "a JSON object",
    "Mapping": "a JSON object",
    "list": "a list",
    "tuple": "a list",
}


def check_types(obj: Any) -> None:
    """Raise `ConfigTypeError` (a `ConfigError` and a `TypeError`) for the first field of the
    dataclass `obj` whose value its annotation does not allow. Every section's `__post_init__`
    starts with it (`Section.__post_init__`)."""
    for f in dataclasses.fields(obj):
        why = check_type(f.type, getattr(obj, f.name))
        if why is not None:
            raise field_error(obj, f.name, why, kind=ConfigTypeError)


# -- reading a section ---------------------------------------------------------------------------
def _as_section(section: Any, path: str) -> Mapping[str, Any]:
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigTypeError(
            path, f"must be a JSON object of keys, got {section!r} ({type(section).__name__})"
        )
    return section


def translate_section(cls: type, section: Any, path: str) -> dict[str, Any]:
    """`cls`'s keyword arguments from the DeepSpeed keys written in `section` (at `path`): keys
    checked, aliases renamed, values converted and type-checked (module docstring). Keys not
    written are left out, so the fields' defaults apply. Errors are `ConfigError`s at the key's
    path."""
    section = _as_section(section, path)
    if getattr(cls, "ds_auto_is_default", False):  # Note ["auto" in a DeepSpeed model section]
        section = {k: v for k, v in section.items() if not (type(v) is str and v == "auto")}
    keys = ds_keys(cls)
    aliases = {a: name for name, (_, k) in keys.items() for a in k.aliases}
    extra = getattr(cls, "ds_extra", None) or {}
    check_keys(
        section,
        keys.keys() | aliases.keys() | extra.keys(),
        path,
        unsupported=unsupported_keys(cls),
    )
    values = dict(section)
    for old, new in aliases.items():
        if old in values:
            if new in values and values[new] != values[old]:
                raise ConfigError(
                    join_path(path, old),
                    f"another name of {new!r}, which is also set, differently; keep only {new!r}",
                )
            values[new] = values.pop(old)
    written = _written(keys, section)
    kwargs: dict[str, Any] = {}
    for name, (f, k) in keys.items():
        if name not in values:
            continue
        where = join_path(path, written.get(name, name))
        kwargs[f.name] = _read_value(f, k, values[name], where)
    return kwargs


# Note ["auto" in a DeepSpeed model section]
# Hugging Face's ds_configs write "auto" for what the Trainer fills in when training starts
# (`reduce_bucket_size`, `stage3_prefetch_bucket_size`, `bf16.enabled`). A client that hands such
# a config to `initialize` before the Trainer filled it (TRL prepares its reference model so)
# still runs on DeepSpeed 0.19.8: its pydantic config models (`DeepSpeedConfigModel`) drop every
# key whose value is "auto", so the key takes its default. The sections DeepSpeed reads that way
# set `ds_auto_is_default` (zero_optimization and its offload sections, fp16, bf16,
# comms_logger, tensor_parallel) and mean the same; elsewhere "auto" is a value like any other
# (the batch triple and `pipeline.stages` read it themselves; a key that cannot take it names it).


def _written(keys: Mapping[str, tuple[dataclasses.Field, Key]], section: Mapping) -> dict:
    """`{key: the name the user wrote}` for keys written under an alias."""
    return {
        name: alias
        for name, (_, k) in keys.items()
        for alias in k.aliases
        if alias in section and name not in section
    }


def _read_value(f: dataclasses.Field, k: Key, value: Any, where: str) -> Any:
    if k.section is not None:
        if value is None and f.default is None:
            return None  # an optional section written as null: left out
        return _section_class(k.section).from_section(value, path=where)
    if k.read is not None:
        try:
            value = k.read(value)
        except ConfigError:
            raise
        except (ValueError, TypeError) as e:
            kind = ConfigTypeError if isinstance(e, TypeError) else ConfigError
            raise kind(where, f"{e}") from None
    elif isinstance(value, float) and value.is_integer() and "int" in _parts(f.type):
        value = int(value)  # DeepSpeed configs write counts as floats: 5e8
    why = check_type(f.type, value)
    if why is not None:
        raise ConfigTypeError(where, f"{why} ({f.name})" if k.read else why)
    return value


def build(cls: type, path: str, kwargs: Mapping[str, Any], section: Mapping | None = None) -> Any:
    """`cls(**kwargs)`, with the errors of its own checks renamed after the key the user wrote:
    a `field_error` for a field read from a key becomes `"<path>.<key>: <reason> (Cls.field)"`;
    any other `ValueError`/`TypeError` gets `path` in front."""
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if e.field is not None and e.path == f"{cls.__name__}.{e.field}":
            name = _key_of(cls, e.field, section or {})
            if name is not None:
                raise type(e)(
                    join_path(path, name), f"{e.reason} ({e.path})", field=e.field
                ) from None
        raise
    except (ValueError, TypeError) as e:
        kind = ConfigTypeError if isinstance(e, TypeError) else ConfigError
        raise kind(path, str(e)) from None


def _key_of(cls: type, field: str, section: Mapping) -> str | None:
    """The key `field` is read from, as the user wrote it (an alias if so)."""
    keys = ds_keys(cls)
    written = _written(keys, section)
    return next((written.get(n, n) for n, (f, _) in keys.items() if f.name == field), None)


def read_section(cls: type, section: Any, path: str, /, **context: Any) -> Any:
    """A section object from its DeepSpeed section: `translate_section`, then `build` with the
    `context` (values the section needs from elsewhere, by field name)."""
    return build(cls, path, {**translate_section(cls, section, path), **context}, section)


class Section:
    """Base of a ds_config section dataclass: `from_section` of the one shape every package
    uses, and the type check in `__post_init__` (subclasses call `super().__post_init__()`
    first)."""

    ds_path: ClassVar[str] = ""
    """Where the section sits in a ds_config (`"zero_optimization"`): `from_section`'s default
    path, which every error starts with."""

    ds_auto_is_default: ClassVar[bool] = False
    """Whether a key written `"auto"` means its default here (Note ["auto" in a DeepSpeed model
    section]): True for the sections DeepSpeed reads with its pydantic models."""

    def __post_init__(self) -> None:
        check_types(self)

    @classmethod
    def from_section(
        cls, section: Mapping[str, Any] | None = None, *, path: str | None = None, **context: Any
    ) -> Any:
        """The section's object from its ds_config dict (None or `{}`: the defaults). `path`:
        the section's key path, which errors name (default `ds_path`); `context`: values from
        elsewhere in the ds_config, by field name."""
        return read_section(cls, section, cls.ds_path if path is None else path, **context)


# -- the JSON Schema -----------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (`field: int = 0` then `\"\"\"...\"\"\"`),
    by field name, inherited fields included: the one description that the API reference, the
    JSON Schema and the config reference all show. Fields without one are left out."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _class_doc(cls: type) -> str:
    return " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())


def _jsonable(value: Any) -> tuple[bool, Any]:
    value = list(value) if isinstance(value, tuple) else value
    try:
        json.dumps(value)
    except TypeError:
        return False, None
    return True, value


def _field_default(f: dataclasses.Field) -> tuple[bool, Any]:
    if f.default is not dataclasses.MISSING:
        return _jsonable(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _jsonable(f.default_factory())
    return False, None


def key_schema(f: dataclasses.Field, k: Key, doc: str) -> dict[str, Any]:
    """The JSON Schema of one key: its section's object, or its type, description and default
    (module docstring), with `k.schema` on top."""
    if k.section is not None:
        sub = _section_class(k.section)
        return section_schema(sub, description=_class_doc(sub) or doc or None)
    out: dict[str, Any] = {}
    kinds = [_JSON[p] for p in _parts(f.type) if p in _JSON]
    if kinds and len(kinds) == len(_parts(f.type)):
        out["type"] = kinds[0] if len(kinds) == 1 else kinds
    out["description"] = f"{doc} {k.derived}".strip() if k.derived else doc
    has, default = _field_default(f)
    if has and not k.derived:
        out["default"] = default
    out.update(k.schema)
    if "anyOf" in k.schema:  # the alternatives say the type (an int or "auto")
        out.pop("type", None)
    return out


def section_schema(cls: type, description: str | None = None) -> dict[str, Any]:
    """The JSON Schema (an object with `additionalProperties: false`) of the section `cls`:
    every key it reads (aliases included), nested sections as nested objects, and the DeepSpeed
    keys it accepts only at their default."""
    docs = field_docs(cls)
    props: dict[str, Any] = {}
    for name, (f, k) in ds_keys(cls).items():
        props[name] = key_schema(f, k, docs.get(f.name, ""))
        for alias in k.aliases:  # the same value, under another name
            props[alias] = {**props[name], "description": f"Another name of `{name}`."}
    for name, prop in (getattr(cls, "ds_extra", None) or {}).items():
        props[name] = dict(prop)
    for name, entry in sorted(unsupported_keys(cls).items()):
        if name in props:  # a field took the key over: its entry here would never be read
            raise TypeError(f"{cls.__name__}.ds_unsupported lists {name!r}, a key it reads")
        accepted = (
            "Refused."
            if entry.refused
            else "Accepted only at the default shown"
            + "".join(f" or {json.dumps(v)}" for v in entry.also)
            + "."
        )
        props[name] = {"description": f"Not supported: {entry.why}. {accepted}"}
        if not entry.refused:
            props[name]["default"] = entry.accepted
    described = description or _class_doc(cls)
    if getattr(cls, "ds_auto_is_default", False):
        described += ' A key written `"auto"` takes its default, as in DeepSpeed.'
    return {
        "type": "object",
        "description": described,
        "properties": props,
        "additionalProperties": False,
    }


def is_unsupported(prop: Mapping[str, Any]) -> bool:
    """Whether a schema property is a DeepSpeed key accepted only at its default (or refused)."""
    return str(prop.get("description", "")).startswith("Not supported")


def is_alias(prop: Mapping[str, Any]) -> bool:
    """Whether a schema property is another name of a key listed beside it."""
    return str(prop.get("description", "")).startswith("Another name of")


# -- the resolved values -------------------------------------------------------------------------
def section_rows(
    cls: type, obj: Any, given: Mapping[str, Any] | None, path: str
) -> list[tuple[str, Any, str]]:
    """`(key path, value, source)` for every key of section `cls` (nested sections' keys at
    their full path, `zero_optimization.offload_optimizer.device`), where `obj` is the section
    as resolved (None: off, every key at its default) and `given` the dict the user wrote.

    source: **given** (written, shown as written), **default** (left out, and the resolved value
    is the documented default), **derived** (left out or `"auto"`, and the value came from other
    keys)."""
    given = given if isinstance(given, Mapping) else {}
    docs = field_docs(cls)
    rows: list[tuple[str, Any, str]] = []
    for name, (f, k) in ds_keys(cls).items():
        where = join_path(path, name)
        # "auto" (DeepSpeed's and the Hugging Face Trainer's "fill it in") is resolved, not given.
        written = next((n for n in (name, *k.aliases) if n in given and given[n] != "auto"), None)
        if k.section is not None:
            sub_cls = _section_class(k.section)
            sub = getattr(obj, f.name, None) if obj is not None else None
            sub = sub if isinstance(sub, sub_cls) else None
            sub_given = given.get(written) if written is not None else None
            rows += section_rows(sub_cls, sub, sub_given, where)
            continue
        if written is not None:
            rows.append((where, given[written], "given"))
            continue
        prop = key_schema(f, k, docs.get(f.name, ""))
        has, static = ("default" in prop, prop.get("default"))
        if not has:
            has, static = _field_default(f)
        if obj is None:
            rows.append((where, static if has else "-", "default"))
            continue
        value = getattr(obj, f.name)
        applied = k.read(static) if (has and k.read is not None and "default" in prop) else static
        if has and value == applied:
            rows.append((where, static, "default"))
        else:
            shown, value = _jsonable(value)
            rows.append((where, value if shown else str(getattr(obj, f.name)), "derived"))
    for name, prop in (getattr(cls, "ds_extra", None) or {}).items():
        if name in given:
            rows.append((join_path(path, name), given[name], "given"))
        else:
            rows.append((join_path(path, name), prop.get("default", "-"), "default"))
    return rows
