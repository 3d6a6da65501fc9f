"""`deepspeed.git_version_info`: `version` (the DeepSpeed API level minispeed follows, then
`+minispeed.` and minispeed's own version: what the `deepspeed` distribution of
`packages/deepspeed_compat` is versioned), `git_hash` and `git_branch` (`None`: minispeed records
no build commit). `minispeed_version` is minispeed's own (a source checkout without installed
metadata says so), the engine's `__version__`."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _installed

__all__ = ["DEEPSPEED_API", "git_branch", "git_hash", "minispeed_version", "version"]


def _minispeed_version() -> str:
    try:
        return _installed("minispeed")
    except PackageNotFoundError:
        return "0.0.0+source"


DEEPSPEED_API = "0.19.8"
minispeed_version = _minispeed_version()
version = f"{DEEPSPEED_API}+minispeed.{minispeed_version}"
git_hash = None
git_branch = None
