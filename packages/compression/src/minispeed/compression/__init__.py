"""minispeed.compression: quantization-aware training, pruning and layer reduction of a model,
driven by DeepSpeed's `compression_training` config section (docs/packages/compression.md).

Reading order: `quantize.py` (the math: fake quantization with a straight-through gradient,
the top-k mask), `layer.py` (`CompressedLinear`: what the forward does with each technique),
`config.py` (the section), `apply.py` (`compress`, `Schedule`, `clean`, `init_student`).
"""

from minispeed.compression.apply import Schedule, clean, compress, init_student
from minispeed.compression.config import (
    TECHNIQUES,
    CompressionConfig,
    Group,
    LayerReduction,
    Technique,
)
from minispeed.compression.layer import CompressedConv2d, CompressedEmbedding, CompressedLinear
from minispeed.compression.quantize import fake_quantize, quantize_reference, top_k_mask

__all__ = [
    "TECHNIQUES",
    "CompressedConv2d",
    "CompressedEmbedding",
    "CompressedLinear",
    "CompressionConfig",
    "Group",
    "LayerReduction",
    "Schedule",
    "Technique",
    "clean",
    "compress",
    "fake_quantize",
    "init_student",
    "quantize_reference",
    "top_k_mask",
]
