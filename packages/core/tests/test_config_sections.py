"""The config pattern's primitives (`minispeed.core.config`, `minispeed.core.sections`): an error
that survives pickling, one type check, a section's errors renamed after the key as written, and
a JSON Schema with every key, nested, closed."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import ClassVar

import pytest

from minispeed.core.config import ConfigError, ConfigTypeError, field_error
from minispeed.core.sections import (
    Section,
    Unsupported,
    ds_only,
    ds_refused,
    key,
    section_rows,
    section_schema,
)


def test_config_error_survives_pickling() -> None:
    """Issue 32: its two-argument constructor broke unpickling (an error raised on a worker
    process could not reach its parent)."""
    for error in (
        ConfigError("zero_optimization.stage", "must be 0, 1, 2 or 3, got 5", field="stage"),
        ConfigTypeError("fp16.enabled", "must be true or false, got 'yes'"),
        ConfigError("", "config file 'x.json' does not exist"),
    ):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert (back.path, back.reason, back.field) == (error.path, error.reason, error.field)
    assert isinstance(ConfigTypeError("a", "b"), TypeError | ValueError)


@dataclass(frozen=True)
class Inner(Section):
    """An inner section."""

    ds_path: ClassVar[str] = "outer.inner"

    count_numel: int = key("count", 4)
    """Elements counted."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.count_numel < 1:
            raise field_error(self, "count_numel", f"must be >= 1, got {self.count_numel}")


@dataclass(frozen=True)
class Outer(Section):
    """An outer section."""

    ds_path: ClassVar[str] = "outer"
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "legacy": ds_only(False, "not here; use flag"),
        "gone": ds_refused("never here; use inner"),
        "either": ds_only(1, "one or two only", also=(2,)),
        "monitor": ds_only({"enabled": False, "path": ""}, "no monitor"),
    }

    flag: bool = key("flag", False, aliases=("old_flag",))
    """A switch."""
    inner: Inner | None = key("inner", None, section=Inner)
    """The nested section."""


def test_errors_name_the_key_as_written_with_the_field_after() -> None:
    with pytest.raises(ConfigError) as err:
        Outer.from_section({"inner": {"count": 0}})
    assert str(err.value) == "outer.inner.count: must be >= 1, got 0 (Inner.count_numel)"
    with pytest.raises(ConfigTypeError, match=r"^outer.old_flag: must be true or false, got 1"):
        Outer.from_section({"old_flag": 1})
    with pytest.raises(ConfigError, match=r"^outer.inner.cuont: unknown key .*'count'"):
        Outer.from_section({"inner": {"cuont": 2}})
    with pytest.raises(ConfigError) as err:
        Outer.from_section({"legacy": True})
    assert str(err.value) == (
        "outer.legacy: DeepSpeed's 'legacy' is not supported by minispeed: not here; use flag; "
        "remove it (false is accepted)"
    )
    for value in (None, False, {}):  # refused at every value
        with pytest.raises(
            ConfigError, match=r"^outer.gone: .*not supported.*use inner; remove it$"
        ):
            Outer.from_section({"gone": value})
    assert Outer.from_section({"legacy": False, "inner": {"count": 5e0}}).inner == Inner(5)
    with pytest.raises(ConfigError, match=r"^Inner.count_numel: must be >= 1"):
        Inner(0)  # built directly: our field's name
    with pytest.raises(ConfigTypeError, match=r"^Inner.count_numel: must be an integer"):
        Inner(True)  # a flag is not a count


def test_a_key_accepted_at_several_values_and_a_switched_off_section() -> None:
    assert Outer.from_section({"either": 2, "monitor": {"enabled": False, "path": "/runs"}})
    assert Outer.from_section({"monitor": {"path": "/runs"}})  # off by default: read by nobody
    with pytest.raises(ConfigError) as err:
        Outer.from_section({"either": 3})
    assert str(err.value).endswith("remove it (1 or 2 are accepted)")
    with pytest.raises(ConfigError, match=r"^outer.monitor: .*no monitor"):
        Outer.from_section({"monitor": {"enabled": True, "path": "/runs"}})
    assert "or 2" in section_schema(Outer)["properties"]["either"]["description"]


def test_the_schema_holds_every_key_nested_and_closed() -> None:
    schema = section_schema(Outer)
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {
        "flag", "old_flag", "inner", "legacy", "gone", "either", "monitor"
    }  # fmt: skip
    assert schema["properties"]["legacy"]["default"] is False  # the one value accepted
    assert "default" not in schema["properties"]["gone"]
    inner = schema["properties"]["inner"]
    assert inner["additionalProperties"] is False
    assert inner["properties"]["count"] == {
        "type": "integer",
        "description": "Elements counted.",
        "default": 4,
    }

    @dataclass(frozen=True)
    class Clash(Outer):
        ds_unsupported: ClassVar[dict[str, Unsupported]] = {"flag": ds_only(False, "x")}

    with pytest.raises(TypeError, match=r"Clash\.ds_unsupported lists 'flag', a key it reads"):
        section_schema(Clash)  # a field took the key over: one declaration per key
    rows = section_rows(Outer, Outer.from_section({"inner": {}}), {"inner": {}}, "outer")
    assert ("outer.inner.count", 4, "default") in rows and ("outer.flag", False, "default") in rows
