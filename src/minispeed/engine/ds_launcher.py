"""`deepspeed.launcher` and `deepspeed.launcher.runner` (named `ds_launcher` here because the
engine's `launcher` is `minispeed run`'s): the name clients read from DeepSpeed's launcher.

`DEEPSPEED_ENVIRONMENT_NAME` (".deepspeed_env") is the file of `NAME=value` lines DeepSpeed's
multi-node launcher exports on every node; accelerate writes it before a multi-node launch
through DeepSpeed's `deepspeed` command. minispeed's launcher is `minispeed run`
(`docs/cli/run.md`), which does not read that file: export the variables in the job's
environment instead. The single-node `accelerate launch` path starts torchrun and never reads it.
"""

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
