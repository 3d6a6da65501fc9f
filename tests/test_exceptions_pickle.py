"""Every exception type of minispeed survives pickling, as an error raised in a worker process
must to reach its parent (`multiprocessing`'s result thread unpickles it; one that cannot be
rebuilt kills that thread and the parent waits forever instead of failing).

The types are found by importing every module of every package, so a new exception class is
checked (or named here with its constructor's arguments) without anyone remembering to.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

PACKAGES = [
    "minispeed.core",
    "minispeed.comm",
    "minispeed.zero",
    "minispeed.offload",
    "minispeed.pipeline",
    "minispeed.moe",
    "minispeed.tensor_parallel",
    "minispeed.inference",
    "minispeed.profiler",
    "minispeed.compression",
    "minispeed.engine",
]
# The constructors that take more than a message.
ARGS = {
    "minispeed.core.config.ConfigError": ("zero_optimization.stage", "must be 0-3"),
    "minispeed.core.config.ConfigTypeError": ("zero_optimization.stage", "must be an int"),
    "minispeed.core.op_builder.builder.OpBuildError": ("cast", "no compiler", "g++ not found"),
}


def _exception_types() -> dict[str, type]:
    found = {}
    for name in PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            if info.name.endswith("__main__"):
                continue
            for obj in vars(importlib.import_module(info.name)).values():
                if (
                    inspect.isclass(obj)
                    and issubclass(obj, BaseException)
                    and obj.__module__.startswith("minispeed.")
                ):
                    found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


TYPES = _exception_types()


def test_the_walk_finds_the_exception_types() -> None:
    assert len(TYPES) >= 20 and "minispeed.zero.stage3.access.ParameterNotGatheredError" in TYPES


def _arguments(name: str) -> tuple:
    """ARGS' entry, else the nearest named base's (a ConfigError subclass takes its two), else
    a message."""
    for base in TYPES[name].__mro__:
        key = f"{base.__module__}.{base.__qualname__}"
        if key in ARGS:
            return ARGS[key]
    return ("a message naming the fix",)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_exception_survives_pickling(name: str) -> None:
    error = TYPES[name](*_arguments(name))
    error.extra = "an attribute set after construction"
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert back.extra == error.extra
