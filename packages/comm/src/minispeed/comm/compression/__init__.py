"""Gradient compression for communication: 1-bit, top-k, int8/int4, all with error feedback.

Reading order:

1. `compressor` — the contract (compress / decompress / bytes) and the wire layout;
2. `onebit`, `topk`, `quantize` — the three compressors, each with its error
   bound derived in its docstring;
3. `error_feedback` — why the accumulated error stays bounded;
4. `compressed_allreduce` — 1-bit all-reduce (all_to_all + all_gather of packed bits,
   worker and server residuals) and top-k all-reduce;
5. `quantized_collectives` — quantized all-gather (qwZ) and reduce-scatter (qgZ);
6. `wire` — bytes on the wire per collective, as functions;
7. `ops` and `reference` — the C++/CUDA kernels and their pure-PyTorch twins.

Optimizers that use them: `minispeed.comm.optim` (`OnebitAdam`, `OnebitLamb`).
"""

from minispeed.comm.compression.compressed_allreduce import OnebitAllReduce, TopkAllReduce
from minispeed.comm.compression.compressor import Compressor, Packed, ScaledCodes
from minispeed.comm.compression.error_feedback import ErrorFeedback
from minispeed.comm.compression.onebit import OnebitCompressor
from minispeed.comm.compression.quantize import BlockQuantizer
from minispeed.comm.compression.quantized_collectives import (
    quantized_all_gather_into_tensor,
    quantized_reduce_scatter_tensor,
)
from minispeed.comm.compression.topk import TopkCompressor, TopkPacked

__all__ = [
    "BlockQuantizer",
    "Compressor",
    "ErrorFeedback",
    "OnebitAllReduce",
    "OnebitCompressor",
    "Packed",
    "ScaledCodes",
    "TopkAllReduce",
    "TopkCompressor",
    "TopkPacked",
    "quantized_all_gather_into_tensor",
    "quantized_reduce_scatter_tensor",
]
