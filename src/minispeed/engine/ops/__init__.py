"""DeepSpeed's `deepspeed.ops` import path: only `adam` (`FusedAdam`, `DeepSpeedCPUAdam`), the
optimizers scripts construct themselves."""
