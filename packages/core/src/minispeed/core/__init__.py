"""minispeed.core: the ground every minispeed package stands on.

- `minispeed.core.accelerator` — one object for device, streams, events, memory, comm backend.
- `minispeed.core.op_builder` — JIT builds of C++/CUDA ops with a pure-PyTorch fallback.
- `minispeed.core.testing` — run a test body on N gloo processes, with timeouts and rank tags.
- `minispeed.core.report` — `python -m minispeed.core.report`: the environment and every op.
- `minispeed.core.logging` — the rank-aware `minispeed` logger.
- `minispeed.core.compiling` — `eager(fn)`: code dynamo never traces (a graph break of its own).
"""

from minispeed.core.accelerator import get_accelerator, set_accelerator

__all__ = ["get_accelerator", "set_accelerator"]
