"""`deepspeed.compression`: DeepSpeed's compression library (ZeroQuant, XTC) over
`minispeed.compression` (docs/packages/compression.md): `init_compression`,
`redundancy_clean`, `compression_scheduler`."""

from minispeed.engine.compression.compress import init_compression, redundancy_clean
from minispeed.engine.compression.scheduler import compression_scheduler

__all__ = ["compression_scheduler", "init_compression", "redundancy_clean"]
