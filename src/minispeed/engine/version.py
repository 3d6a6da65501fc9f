"""minispeed's version, as `deepspeed.__version__` answers it: scripts print or compare it, and
the import-swapped module answers with minispeed's own (a source checkout without installed
metadata says so). Apart from the face so that `git_version_info` (an adapter) reads it without
importing the face."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]


def _version() -> str:
    try:
        return version("minispeed")
    except PackageNotFoundError:
        return "0.0.0+source"


__version__ = _version()
