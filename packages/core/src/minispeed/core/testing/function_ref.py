"""Naming a test body so that a worker process can find it: (module name, file path, qualname).

A pool worker was started before the test module was imported, so the body cannot travel by
value, and pickle's by-name lookup is not enough either: pytest runs with
`--import-mode=importlib`, which imports `packages/zero/tests/test_x.py` under a made-up
dotted name without putting its directory on `sys.path`. So the parent sends three strings and
the worker resolves them itself (`FunctionRef.resolve`):

1. if `sys.modules` already holds a module of that name loaded from the same file, use it
   (the cache: a module is executed once per worker, not once per test);
2. otherwise insert the file's directory at the front of `sys.path` (so helper modules beside
   the tests import, as a `conftest.py` makes them import in the parent); a helper or library
   module is then imported normally if that finds the same file; a test file (or a module
   import cannot find) is executed from its file under the same name, after creating empty
   parent modules for a dotted name (as pytest does), with pytest's assertion rewriting for
   test files, so `assert a == b` in a body reports both values as in a plain test;
3. walk the qualname; a `@distributed_test` wrapper found there is replaced by the body it
   wraps (the attribute `BODY_ATTR`).

Keeping the parent's module name matters: a class defined in the test module and returned from a
body unpickles in the parent, because both processes know the module by one name.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["BODY_ATTR", "FunctionRef"]

BODY_ATTR = "__minispeed_distributed_body__"
"""Attribute of a `@distributed_test` wrapper that holds the per-rank body it runs."""


def _unwrap_body(obj: Any) -> Any:
    return getattr(obj, BODY_ATTR, obj)


def _same_file(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


@dataclass(frozen=True)
class FunctionRef:
    """Where a module-level function lives, in a form that survives a trip to another process."""

    module: str
    """`fn.__module__` as the calling process knows it (pytest's dotted name in importlib mode)."""
    qualname: str
    """`fn.__qualname__`: a dotted path from the module to the function."""
    file: str | None
    """The module's source file; `None` for modules without one (then only import by name works)."""

    @classmethod
    def of(cls, fn: Callable[..., Any], *, check_reachable: bool = True) -> FunctionRef:
        """Name `fn`; raise `ValueError` for anything a worker could not look up by name.

        `check_reachable` also verifies, in this process, that `module.qualname` leads back to
        `fn` (it is off while a decorator runs, before the module attribute exists).
        """
        fn = _unwrap_body(fn)
        if isinstance(fn, functools.partial):
            raise ValueError(
                "run_distributed cannot send a functools.partial to its workers; define the body "
                "at module level and pass the bound values with args=/kwargs="
            )
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", None)
        if not callable(fn) or not isinstance(module, str) or not isinstance(qualname, str):
            raise ValueError(
                f"run_distributed needs a plain function, got {fn!r}; define the body at module "
                "level as `def body(rank, world_size, ...)`"
            )
        if "<lambda>" in qualname or "<locals>" in qualname:
            raise ValueError(
                f"{module}.{qualname} is a lambda or a closure, which worker processes cannot look "
                "up by name; define the body at module level and pass captured values with "
                "args=/kwargs="
            )
        mod = sys.modules.get(module)
        file = getattr(mod, "__file__", None)
        if file is None:
            code = getattr(fn, "__code__", None)
            file = getattr(code, "co_filename", None)
            if file is not None and not os.path.isfile(file):
                file = None
        ref = cls(module=module, qualname=qualname, file=os.path.abspath(file) if file else None)
        if check_reachable and mod is not None:
            found = ref._walk(mod)
            if found is not fn:
                raise ValueError(
                    f"{module}.{qualname} does not lead back to the function passed to "
                    "run_distributed (was it redefined, or wrapped by another decorator?); "
                    "define the body at module level under its own name"
                )
        return ref

    def __str__(self) -> str:
        return f"{self.module}.{self.qualname}"

    def _walk(self, module: ModuleType) -> Any:
        obj: Any = module
        for part in self.qualname.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return _unwrap_body(obj)

    def resolve(self) -> Callable[..., Any]:
        """In a worker: load (or reuse) the module and return the body; errors name the fix."""
        module = self._load_module()
        fn = self._walk(module)
        if fn is None or not callable(fn):
            raise AttributeError(
                f"worker found module {self.module} (file {self.file}) but no callable "
                f"{self.qualname!r} in it; define the body at module level"
            )
        return fn

    def _load_module(self) -> ModuleType:
        cached = sys.modules.get(self.module)
        if cached is not None and (
            self.file is None or _same_file(getattr(cached, "__file__", None), self.file)
        ):
            return cached
        if self.file is None:
            return importlib.import_module(self.module)
        directory = os.path.dirname(self.file)
        if directory not in sys.path:
            sys.path.insert(0, directory)
        # A body in the caller's main script: the worker's __main__ is multiprocessing's own,
        # so load the script under another name (its `if __name__ == "__main__"` guard holds).
        name = "__mp_main_body__" if self.module == "__main__" else self.module
        if not _is_test_file(self.file) and name == self.module:
            # A library or helper module: the normal import is the faithful one.
            try:
                module = importlib.import_module(name)
            except ImportError:
                pass
            else:
                if _same_file(getattr(module, "__file__", None), self.file):
                    return module
        _insert_missing_parents(name)
        cached = sys.modules.get(name)  # importing a parent package may have imported it
        if cached is not None and _same_file(getattr(cached, "__file__", None), self.file):
            return cached
        spec = importlib.util.spec_from_file_location(name, self.file)
        if spec is None or spec.loader is None:
            raise ImportError(
                f"cannot load {self.module} from {self.file}: not a Python source file"
            )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            code = _compile_with_assert_rewriting(self.file)
            if code is None:
                spec.loader.exec_module(module)
            else:
                exec(code, module.__dict__)
        except BaseException:
            del sys.modules[name]
            raise
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
        return module


def _insert_missing_parents(name: str) -> None:
    """Make `a` and `a.b` exist for `a.b.c`, so pickle's `__import__` finds the module."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent in sys.modules:
            continue
        try:
            importlib.import_module(parent)
        except ImportError:
            sys.modules[parent] = ModuleType(
                parent, doc="empty parent made by minispeed.core.testing"
            )


def _is_test_file(file: str) -> bool:
    """pytest's default `python_files` patterns: the files whose asserts pytest rewrites."""
    base = os.path.basename(file)
    return base.startswith("test_") or base.endswith("_test.py")


def _compile_with_assert_rewriting(file: str) -> Any:
    """The file's code with pytest's assert rewriting if it is a test module and pytest is here."""
    if not _is_test_file(file):
        return None
    try:
        from _pytest.assertion.rewrite import rewrite_asserts
    except ImportError:
        return None
    with open(file, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=file)
    try:
        rewrite_asserts(tree, source, file, None)
    except Exception:  # a private pytest API: if it changes, plain asserts still work
        return None
    return compile(tree, file, "exec", dont_inherit=True)
