"""Each package installs alone, with only its declared minispeed dependencies, and passes its tests.

Runs ``scripts/check_install.py`` (fresh venvs, non-editable installs). For the packages in the
Makefile's ``ISOLATED`` list this is where their tests run in ``make test`` (the main run leaves
their folders out, so each test runs once). The negative case builds a
two-package tree in which ``alpha`` imports ``minispeed.beta`` without declaring it, and checks that
the script fails: the check can catch what it is for.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check_install.py"


def _write_package(root: Path, name: str, deps: list[str], module: str, test: str) -> None:
    pkg = root / name
    (pkg / "src" / "minispeed" / name).mkdir(parents=True)
    (pkg / "tests").mkdir()
    dep_list = ", ".join(f'"{d}"' for d in deps)
    (pkg / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [build-system]
        requires = ["hatchling>=1.21"]
        build-backend = "hatchling.build"
        [project]
        name = "minispeed-{name}"
        version = "0.0.1"
        dependencies = [{dep_list}]
        [tool.hatch.build.targets.wheel]
        packages = ["src/minispeed"]
        """)
    )
    (pkg / "src" / "minispeed" / name / "__init__.py").write_text(module)
    (pkg / "tests" / f"test_{name}.py").write_text(test)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=1400
    )


def test_undeclared_sibling_import_fails_the_check(tmp_path: Path) -> None:
    root = tmp_path / "packages"
    _write_package(root, "beta", [], "VALUE = 2\n", "def test_b():\n    import minispeed.beta\n")
    _write_package(
        root,
        "alpha",
        [],  # alpha uses beta but does not declare it
        "from minispeed.beta import VALUE\n",
        "def test_a():\n    import minispeed.alpha\n",
    )
    bad = _run("--packages-root", str(root), "alpha")
    assert bad.returncode != 0, bad.stdout + bad.stderr
    assert "No module named 'minispeed.beta'" in bad.stdout + bad.stderr

    # Declaring the dependency fixes it: the same check passes.
    pyproject = root / "alpha" / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace("dependencies = []", 'dependencies = ["minispeed-beta"]')
    )
    good = _run("--packages-root", str(root), "alpha")
    assert good.returncode == 0, good.stdout + good.stderr


#: Each spec is a package and the extras installed with it; zero's [offload] extra makes its
#: ZeRO-Offload tests run here instead of skipping.
ISOLATED = ["core", "zero[offload]", "offload"]


def test_the_makefile_leaves_out_exactly_the_packages_tested_here() -> None:
    """A package left out of the main run but not checked here would have its tests run nowhere."""
    makefile = (REPO / "Makefile").read_text()
    line = next(ln for ln in makefile.splitlines() if ln.startswith("ISOLATED :="))
    assert line.split(":=", 1)[1].split() == ISOLATED, (line, ISOLATED)
    assert "--ignore=packages/" in makefile


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("package", ISOLATED)
def test_package_installs_alone_and_passes_its_tests(package: str) -> None:
    result = _run(package)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
