"""`deepspeed.sequence.layer`: `DistributedAttention`, Megatron-DeepSpeed's Ulysses wrapper
(minispeed.tensor_parallel.ulysses: its layouts, costs and what it supports)."""

from minispeed.tensor_parallel.ulysses import DistributedAttention

__all__ = ["DistributedAttention"]
