"""`deepspeed.git_version_info`: `version` (the DeepSpeed API level minispeed follows, then
`+minispeed.` and minispeed's own version: what the `deepspeed` distribution of
`packages/deepspeed_compat` is versioned), `git_hash` and `git_branch` (`None`: minispeed records
no build commit). `minispeed_version` is minispeed's own (a source checkout without installed
metadata says so), the engine's `__version__`."""

from minispeed.engine.version import __version__ as minispeed_version

__all__ = ["DEEPSPEED_API", "git_branch", "git_hash", "minispeed_version", "version"]


DEEPSPEED_API = "0.19.8"
version = f"{DEEPSPEED_API}+minispeed.{minispeed_version}"
git_hash = None
git_branch = None
