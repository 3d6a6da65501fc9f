"""Write `packages/deepspeed_compat/src/deepspeed/` from `minispeed.engine.deepspeed_paths`.

```bash
.venv/bin/python scripts/sync_deepspeed_compat.py           # write the tree
.venv/bin/python scripts/sync_deepspeed_compat.py --check   # exit 1 if it differs
```

One module per table entry (a package, `<name>/__init__.py`, where another entry lies below it):

- an adapter re-exports its engine module: `from <engine module> import *` with its `__all__`,
  its adapter children imported by their full names (so `deepspeed.runtime.lr_schedules`
  resolves as an attribute after `import deepspeed`, and is the `deepspeed` module, not the
  engine's one the star import bound to that name), and a module `__getattr__` that hands any
  other attribute over to the engine module (a private name a client reaches for is the
  engine's same object) and, for a name the engine module lacks, raises naming the module, the
  name and the migration page (`deepspeed_paths.adapted_attribute`);
- a refused module calls `minispeed.engine.deepspeed_paths.refuse`, which raises the
  `ImportError` naming what to use instead. The refused modules are the table's `REFUSED` and,
  for every public module of DeepSpeed 0.19.8 no adapter answers
  (`tests/engine/fixtures/ds_modules.json`, recorded by `scripts/record_ds_modules.py`), its
  first component that is not an adapter (`deepspeed_paths.refused_modules`): one module
  refuses itself and everything below it, so no refused module has children of its own.

The root also takes `__version__` from `minispeed.engine.git_version_info` (the distribution's
version). tests/engine/test_compat_paths.py runs `--check`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "packages" / "deepspeed_compat" / "src"
PUBLIC = ROOT / "tests" / "engine" / "fixtures" / "ds_modules.json"
HEADER = (
    "Generated from `minispeed.engine.deepspeed_paths` by `scripts/sync_deepspeed_compat.py`; "
    "do not edit."
)


def _table() -> tuple[dict[str, str], list[str], list[str]]:
    """The adapters, the refused modules (see the module's docstring), and which of DeepSpeed's
    public modules are packages."""
    sys.path.insert(0, str(ROOT / "src"))
    from minispeed.engine.deepspeed_paths import ADAPTERS, refused_modules

    public = json.loads(PUBLIC.read_text())
    return ADAPTERS, refused_modules(public["modules"]), public["packages"]


def _children(name: str, names: list[str]) -> list[str]:
    return sorted(n.rpartition(".")[2] for n in names if n.rpartition(".")[0] == name)


def _path(name: str, names: list[str]) -> Path:
    parts = name.split(".")
    if any(n.startswith(name + ".") for n in names):
        return Path(*parts, "__init__.py")
    return Path(*parts[:-1], parts[-1] + ".py")


def _adapter(name: str, target: str, children: list[str]) -> str:
    lines = [
        f'"""`{name}`: minispeed\'s `{target}` under DeepSpeed\'s name.',
        "",
        f'{HEADER}"""',
        "",
        "import importlib as _importlib",
        "",
        f"import {target} as _adapter",
        "from minispeed.engine.deepspeed_paths import adapted_attribute as _adapted_attribute",
        f"from {target} import *  # noqa: F403",
        f"from {target} import __all__  # noqa: F401",
    ]
    if name == "deepspeed":
        lines.append("from minispeed.engine.git_version_info import version as __version__")
    if children:  # imported by name: the star import bound the engine's modules to these names
        lines += [
            "",
            f"for _child in {tuple(children)!r}:",
            '    _importlib.import_module(f"{__name__}.{_child}")',
        ]
        shadowed = _shadowed(target, children)
        if shadowed:  # as in DeepSpeed, the exported name wins over the submodule's
            lines.append(f"from {target} import {', '.join(shadowed)}  # noqa: E402")
    lines += [
        "",
        "",
        "def __getattr__(name):",
        "    return _adapted_attribute(__name__, _adapter, name)",
        "",
    ]
    return "\n".join(lines)


def _shadowed(target: str, children: list[str]) -> list[str]:
    """The children whose name the engine module also exports as something else (a function
    named as its module, `utils.z3_leaf_module`)."""
    import importlib
    import types

    module = importlib.import_module(target)
    names = set(getattr(module, "__all__", ()))
    return [
        c for c in children if c in names and not isinstance(getattr(module, c), types.ModuleType)
    ]


def _refused(name: str, package: bool) -> str:
    return "\n".join(
        [
            f'"""`{name}`: not provided by minispeed; importing it raises, naming what to use.',
            "",
            f'{HEADER}"""',
            "",
            "from minispeed.engine.deepspeed_paths import refuse",
            "",
            f"refuse(__name__{', package=True' if package else ''})",
            "",
        ]
    )


def render() -> dict[Path, str]:
    """Every file of the tree, by its path under `packages/deepspeed_compat/src`."""
    adapters, refused, packages = _table()
    names = sorted([*adapters, *refused])
    files = {}
    for name in names:
        if name in adapters:
            kids = [c for c in _children(name, names) if f"{name}.{c}" in adapters]
            files[_path(name, names)] = _adapter(name, adapters[name], kids)
        else:
            files[_path(name, names)] = _refused(name, name in packages)
    return files


def differences() -> list[str]:
    """What differs between the tree on disk and `render()` (empty: in sync)."""
    want = render()
    have = {p.relative_to(TREE): p.read_text() for p in (TREE / "deepspeed").rglob("*.py")}
    out = [f"missing: {p}" for p in sorted(set(want) - set(have))]
    out += [f"not in the table: {p}" for p in sorted(set(have) - set(want))]
    out += [f"differs: {p}" for p in sorted(set(want) & set(have)) if want[p] != have[p]]
    return out


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        diff = differences()
        print("\n".join(diff) or "in sync")
        return 1 if diff else 0
    for path in (TREE / "deepspeed").rglob("*.py"):
        path.unlink()
    for path, text in render().items():
        (TREE / path).parent.mkdir(parents=True, exist_ok=True)
        (TREE / path).write_text(text)
    for folder in sorted((TREE / "deepspeed").rglob("*"), reverse=True):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    print(f"wrote {len(render())} modules under {TREE / 'deepspeed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
