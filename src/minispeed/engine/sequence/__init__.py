"""`deepspeed.sequence`: DeepSpeed-Ulysses' attention wrapper (`layer.DistributedAttention`,
minispeed.tensor_parallel.ulysses). DeepSpeed's other modules here (AutoSP, the
vocabulary-parallel losses, FPDT) are not provided."""

from minispeed.engine.sequence import layer

__all__ = ["layer"]
