"""DeepSpeed's `deepspeed.init_inference(model, config=None, **kwargs)` over
`minispeed.inference.init_inference`: returns the engine (not minispeed's `(engine, report)`).

```python
import minispeed.engine as deepspeed
engine = deepspeed.init_inference(gpt, dtype=torch.float32, replace_with_kernel_inject=True)
logits = engine(tokens)
```

`config` is a dict or a JSON path; keyword arguments override it (DeepSpeed's Case 4). Keys read:
`dtype` (`torch.float32`/`"fp32"`, or `torch.int8`/`"int8"` for weight-only int8),
`replace_with_kernel_inject` (alias `kernel_inject`), `tensor_parallel` (alias `tp`: `{"tp_size":
n, "tp_group": g}`) and the deprecated `mp_size`. The report of what was replaced is kept on
`engine.injection_report`.

Different from DeepSpeed: without `dtype`, minispeed runs fp32 (DeepSpeed's default is fp16;
minispeed has no fp16/bf16 inference kernels, so an explicit fp16/bf16 is refused), and a model
that no injection policy recognises (GPT-2, LLaMA and minispeed's GPT are recognised) is refused
even with `replace_with_kernel_inject=False`. Every other DeepSpeed inference key is accepted at
its default value and refused, by name, at any other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

import minispeed.inference as inference
from minispeed.core.config import check_keys

__all__ = ["init_inference"]

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "torch.float32": torch.float32,
    "int8": torch.int8,
    "torch.int8": torch.int8,
}
_ALIASES = {"kernel_inject": "replace_with_kernel_inject", "tp": "tensor_parallel"}
# DeepSpeed inference keys minispeed does not implement, with their DeepSpeed defaults.
_DEFAULTS: dict[str, Any] = {
    "enable_cuda_graph": False,
    "use_triton": False,
    "triton_autotune": False,
    "zero": {},
    "triangular_masking": True,
    "tm": True,
    "moe": {},
    "keep_module_on_host": False,
    "quant": {},
    "checkpoint": None,
    "base_dir": "",
    "set_empty_params": False,
    "save_mp_checkpoint_path": None,
    "checkpoint_config": {},
    "ckpt_config": {},
    "return_tuple": True,
    "training_mp_size": 1,
    "replace_method": "auto",
    "injection_policy": None,
    "injection_dict": None,
    "injection_policy_tuple": None,
    "config": None,
    "args": None,
    "max_out_tokens": 1024,
    "max_tokens": 1024,
    "min_out_tokens": 1,
    "min_tokens": 1,
    "transposed_mode": False,
    "mpu": None,
    "ep_size": 1,
    "ep_group": None,
    "ep_mp_group": None,
    "moe_experts": [1],
    "moe_type": "standard",
}
_KNOWN = {
    "dtype",
    "replace_with_kernel_inject",
    "tensor_parallel",
    "mp_size",
    *_ALIASES,
    *_DEFAULTS,
}


def _options(config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if config is None:
        config = {}
    elif isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    elif not isinstance(config, dict):
        raise TypeError(
            f"init_inference: config must be a dict or a JSON path, got {type(config).__name__}"
        )
    merged = {**config, **kwargs}
    check_keys(merged, _KNOWN, "init_inference")  # core's checker: a did-you-mean, the known
    for key, default in _DEFAULTS.items():
        value = merged.get(key, default)
        if hasattr(value, "value"):  # an enum given by DeepSpeed's own type
            value = value.value
        if value != default:
            raise NotImplementedError(
                f"init_inference({key}={value!r}) is not implemented by minispeed; leave it at "
                f"DeepSpeed's default {default!r}"
            )
    return {_ALIASES.get(k, k): v for k, v in merged.items() if k not in _DEFAULTS}


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> nn.Module:
    """The inference engine for `model` (DeepSpeed's call; see the module docstring).

    Collective when `tensor_parallel.tp_size > 1` (every rank of the group calls it).
    Costs: those of `minispeed.inference.init_inference` (fp32 shares the model's weights;
    int8 stores about a quarter of the block weights' bytes).
    """
    options = _options(config, kwargs)
    dtype = options.get("dtype", torch.float32)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise TypeError(
                f"init_inference(dtype={dtype!r}): minispeed runs fp32 or int8 (weight-only); "
                "fp16/bf16 kernels are not implemented"
            )
        dtype = _DTYPES[dtype]
    tp = options.get("tensor_parallel")
    mp_size = options.get("mp_size", 1)
    if mp_size != 1:
        if tp not in (None, {}):
            raise ValueError(
                "init_inference: give tensor_parallel or the deprecated mp_size, not both"
            )
        tp = {"tp_size": mp_size}
    engine, report = inference.init_inference(
        model,
        dtype=dtype,
        replace_with_kernel_inject=bool(options.get("replace_with_kernel_inject", False)),
        tensor_parallel=tp or None,
    )
    engine.injection_report = report
    return engine
