"""`deepspeed.runtime.activation_checkpointing`: holds `checkpointing` (DeepSpeed's
`deepspeed.checkpointing` is that module)."""

from minispeed.engine.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
