"""`deepspeed.runtime.sequence_parallel`: DeepSpeed-Ulysses' groups (`parallel_state_sp`), over
minispeed's data x sequence grid (`minispeed.engine.sequence_groups`)."""

from minispeed.engine.runtime.sequence_parallel import parallel_state_sp

__all__ = ["parallel_state_sp"]
