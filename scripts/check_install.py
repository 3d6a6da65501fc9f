"""Check that a package installs and passes its tests with only its declared minispeed dependencies.

For each package named on the command line this script

1. reads ``packages/<name>/pyproject.toml`` and follows its ``minispeed-*`` dependencies recursively;
2. creates a fresh venv and installs exactly that set, **non-editable** (so a source file missing from
   the wheel, e.g. a ``csrc/`` file a JIT build needs, fails here);
3. runs ``packages/<name>/tests`` in that venv.

A sibling package that a module or a test imports without declaring it is simply not installed in
that venv, so the import fails and the check fails.

Third-party dependencies (torch above all, a GB-sized install) are not reinstalled per venv: the
script links the current interpreter's site-packages, minus every minispeed distribution, into a
"third-party only" folder that the fresh venv sees through a ``.pth`` file. pip sees torch there
and installs nothing more; the minispeed packages come only from this check's own install.

An extra in brackets (``zero[offload]``) adds the minispeed packages that extra declares, so the
tests of an optional composition run too; without it they skip.

Usage: ``python scripts/check_install.py core zero[offload] offload [-- extra pytest args]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import site
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PREFIX = "minispeed-"


def _minispeed_deps(deps: list[str]) -> list[str]:
    """The minispeed package folder names among requirement strings (``minispeed-tensor-parallel``
    lives in ``packages/tensor_parallel``, its import name)."""
    names = []
    for dep in deps:
        dep_name = dep.split(";")[0].split("[")[0].strip()
        for ch in "<>=!~ ":
            dep_name = dep_name.split(ch)[0]
        if dep_name.startswith(PREFIX):
            names.append(dep_name[len(PREFIX) :].replace("-", "_"))
    return names


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``"zero[offload]"`` -> ``("zero", ["offload"])``: a package and the extras to install."""
    name, _, rest = spec.partition("[")
    extras = [e.strip() for e in rest.rstrip("]").split(",") if e.strip()]
    return name, extras


def declared_closure(spec: str, root: Path) -> list[str]:
    """The package of ``spec`` (``name`` or ``name[extra,...]``), the minispeed packages its named
    extras add, and every minispeed package those depend on, transitively, dependencies first."""
    name, extras = parse_spec(spec)
    order: list[str] = []

    def visit(pkg: str, stack: tuple[str, ...]) -> None:
        if pkg in stack:
            raise SystemExit(f"dependency cycle: {' -> '.join((*stack, pkg))}")
        if pkg in order:
            return
        pyproject = root / pkg / "pyproject.toml"
        if not pyproject.exists():
            raise SystemExit(f"no package {pkg!r}: {pyproject} does not exist")
        project = tomllib.loads(pyproject.read_text())["project"]
        deps = list(project.get("dependencies", []))
        if pkg == name:
            optional = project.get("optional-dependencies", {})
            for extra in extras:
                if extra not in optional:
                    raise SystemExit(f"{name} has no extra {extra!r}; it has {sorted(optional)}")
                deps += optional[extra]
        for dep in _minispeed_deps(deps):
            visit(dep, (*stack, pkg))
        order.append(pkg)

    visit(name, ())
    return order


def third_party_site(dest: Path) -> Path:
    """A folder of links to every entry of this interpreter's site-packages except minispeed's."""
    dest.mkdir(parents=True, exist_ok=True)
    for sp in site.getsitepackages():
        for entry in Path(sp).iterdir():
            low = entry.name.lower()
            if "minispeed" in low or low.startswith("__editable__") or entry.suffix == ".pth":
                continue
            link = dest / entry.name
            if not link.exists():
                link.symlink_to(entry)
    return dest


def check(spec: str, root: Path, workdir: Path, pytest_args: list[str]) -> bool:
    """Install ``spec``'s package and its declared closure from ``root`` into a fresh venv; run
    the package's tests."""
    closure = declared_closure(spec, root)
    name, _ = parse_spec(spec)
    venv = workdir / f"venv-{name}"
    print(f"== {name}: installs {', '.join(closure)} (non-editable) into {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "_third_party.pth").write_text(
        str(third_party_site(workdir / "third_party")) + "\n"
    )
    t0 = time.perf_counter()
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-warn-script-location"]
        + [str(root / p) for p in closure],
        check=True,
    )
    print(f"   installed in {time.perf_counter() - t0:.1f} s", flush=True)
    # Run from a scratch folder so nothing in the repo shadows the installed packages.
    cmd = [py, "-m", "pytest", str(root / name / "tests"), "-q", "-rfE"]
    cmd += ["-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO), *pytest_args]
    result = subprocess.run(cmd, cwd=workdir, env={**os.environ, "PYTHONNOUSERSITE": "1"})
    # pytest exit 5 = no tests collected: a package whose tests folder is still empty passes.
    ok = result.returncode in (0, 5)
    print(f"== {name}: {'ok' if ok else f'FAILED (pytest exit {result.returncode})'}", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "packages", nargs="+", help="package names, each with optional extras: core zero[offload]"
    )
    parser.add_argument("--keep", action="store_true", help="keep the venvs for inspection")
    parser.add_argument(
        "--packages-root", type=Path, default=REPO / "packages", help="the folder of packages"
    )
    args, pytest_args = parser.parse_known_args()
    root = args.packages_root.resolve()
    pytest_args = [a for a in pytest_args if a != "--"]
    workdir = Path(tempfile.mkdtemp(prefix="minispeed-install-check-"))
    try:
        failed = [p for p in args.packages if not check(p, root, workdir, pytest_args)]
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if failed:
        print(f"install check failed for: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
