"""`deepspeed.runtime.activation_checkpointing.checkpointing`: DeepSpeed's long path for
`deepspeed.checkpointing` (`minispeed.engine.checkpointing`)."""

from minispeed.engine.checkpointing import (
    checkpoint,
    configure,
    is_configured,
    non_reentrant_checkpoint,
    reset,
)

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]
