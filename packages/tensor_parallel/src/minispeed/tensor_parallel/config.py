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
from minispeed.core.sections import Section, Unsupported, ds_only, ds_refused, key

__all__ = ["TensorParallelConfig"]


_AUTOTP = "AutoTP's inference keys; minispeed reads autotp_size for training"
_PLAN = (
    "the plan is a ready one by model type, initialize(tensor_parallel_plan=...) or the one "
    "read from the model's structure (auto_plan), not configured by keys"
)
_VOCAB = (
    "the ready plans split the head's vocabulary (compute the loss with "
    "minispeed.tensor_parallel.vocab_parallel_cross_entropy); auto_plan gathers whole logits"
)


@dataclass(frozen=True)
class TensorParallelConfig(Section):
    """Tensor parallelism for training (DeepSpeed section `tensor_parallel`): ZeRO over the data
    axis, clipping over all three (docs: 3D parallelism). The plan is a ready one by model type,
    `initialize(tensor_parallel_plan=...)`, or read from the model's structure as by DeepSpeed's
    AutoTP (`auto_plan`: a model with no ready plan, or given to `tp_model_init`)."""

    ds_path: ClassVar[str] = "tensor_parallel"
    ds_auto_is_default: ClassVar[bool] = True  # DeepSpeed: "auto" is the default
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "dtype": ds_refused("AutoTP's inference dtype; the training dtypes come from fp16 / bf16"),
        "injection_policy_tuple": ds_only(None, _AUTOTP),
        "keep_module_on_host": ds_only(False, _AUTOTP),
        "kernel_inject": ds_only(False, _AUTOTP),
        "replace_with_kernel_inject": ds_only(False, _AUTOTP),
        "preset_model": ds_only(None, _PLAN),
        "partition_config": ds_only(None, _PLAN),
        "tensor_parallel": ds_only({}, "AutoTP's nested inference section; use autotp_size"),
        "tp": ds_only({}, "AutoTP's nested inference section; use autotp_size"),
        "tp_overlap_comm": ds_only(False, "the tensor-parallel all-reduces are not overlapped"),
        "vocab_parallel_ce_backend": ds_only("torch", _VOCAB),
        "vocab_parallel_lm_head": ds_only(None, _VOCAB),
    }

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
