"""`deepspeed.ops`: the optimizers scripts construct themselves: `adam` (`FusedAdam`,
`DeepSpeedCPUAdam`), `adagrad` (`DeepSpeedCPUAdagrad`), `lion` (`DeepSpeedCPULion`)."""

from minispeed.engine.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
