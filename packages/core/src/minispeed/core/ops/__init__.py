"""minispeed.core's compiled ops, each with its pure-PyTorch reference.

- `minispeed.core.ops.cast` — fp32 <-> bf16 (round-to-nearest-even) and fused flatten/unflatten;
  `minispeed.core.ops.cast_reference` holds the reference with the same signatures.
"""
