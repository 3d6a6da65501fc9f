"""`deepspeed.runtime.pipe.topology`: the process topologies of `minispeed.engine.pipe`
(`ProcessTopology` is `minispeed.comm`'s)."""

from minispeed.engine.pipe import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]
