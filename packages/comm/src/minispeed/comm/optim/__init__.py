"""Optimizers that communicate compressed: 1-bit Adam and 1-bit LAMB.

Reading order: `compressed_momentum` (the two phases, shared collectives, checkpoints),
then `onebit_adam` and `onebit_lamb` (each one update rule per phase).
Use them *instead of* DDP: they average gradients (warm-up) or momenta (compressed) themselves.
"""

from minispeed.comm.optim.compressed_momentum import (
    CompressedMomentumOptimizer,
    OnebitPhase,
    OnebitSchedule,
    OnebitScheduled,
)
from minispeed.comm.optim.onebit_adam import OnebitAdam
from minispeed.comm.optim.onebit_lamb import OnebitLamb

__all__ = [
    "CompressedMomentumOptimizer",
    "OnebitAdam",
    "OnebitLamb",
    "OnebitPhase",
    "OnebitSchedule",
    "OnebitScheduled",
]
