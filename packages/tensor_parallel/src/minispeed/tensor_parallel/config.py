"""`TensorParallelConfig`: DeepSpeed's training `tensor_parallel` section, the size of the grid's
tensor axis (the config pattern, `minispeed.core.sections`).

```python
cfg = TensorParallelConfig.from_section({"autotp_size": 2})
cfg.size   # 2: ranks that split each layer (0 or 1 written: 1, no tensor parallelism)
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from minispeed.core.config import field_error
from minispeed.core.sections import Section, key

__all__ = ["TensorParallelConfig"]


@dataclass(frozen=True)
class TensorParallelConfig(Section):
    """Tensor parallelism for training (DeepSpeed section `tensor_parallel`): ZeRO over the data
    axis, clipping over all three (docs: 3D parallelism). The plan is a ready one by model type
    or `initialize(tensor_parallel_plan=...)`; not inferred as by DeepSpeed's AutoTP."""

    ds_path: ClassVar[str] = "tensor_parallel"

    autotp_size: int = key("autotp_size", 0)
    """Tensor-parallel size T (0 or 1: off); world = pipe x data x T, tensor ranks adjacent."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.autotp_size < 0:
            raise field_error(
                self,
                "autotp_size",
                f"must be an integer >= 0 (the tensor-parallel size; 0 or 1: off), got "
                f"{self.autotp_size!r}",
            )

    @property
    def size(self) -> int:
        """T: `autotp_size`, with 0 read as 1 (no tensor parallelism)."""
        return max(self.autotp_size, 1)
