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

The engine is DeepSpeed's `InferenceEngine` in shape: `engine.module` is the model as given,
`engine(tokens)` the fused model's logits (a transformers model's output class around them when
the model is one), and `engine.generate(...)` transformers' `generate` call: greedy decoding
runs on the fused model and its KV cache, any other call on the model's own `generate`
(`minispeed.inference.hf_generate`). Other attributes (`config`, `generation_config`,
`device`, ...) are the model's, so a transformers `pipeline` whose `.model` is replaced by the
engine, as in DeepSpeed's tutorial, keeps working.

A model that no injection policy recognises (GPT-2, LLaMA and minispeed's GPT are recognised)
runs as written, as under DeepSpeed when it has no policy for it: `engine(...)` is the model's
forward and `engine.generate` its own `generate`, with a warning naming the model (int8 is
refused). With `tensor_parallel={"tp_size": n}` such a model, or any model without
`replace_with_kernel_inject`, is cut by its structure as DeepSpeed's AutoTP cuts it
(`minispeed.inference.split_by_structure`: Qwen2, Mistral, OPT, GPT-NeoX, ...): it still runs
its own forward and `generate`, every rank holding the whole logits.

Different from DeepSpeed: without `dtype`, minispeed runs fp32 (DeepSpeed's default is fp16;
minispeed has no fp16/bf16 inference kernels, so an explicit fp16/bf16 is refused). Every other
DeepSpeed inference key is accepted at its default value and refused, by name, at any other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

import minispeed.inference as inference
from minispeed.core.config import check_keys
from minispeed.core.logging import get_logger

__all__ = ["InferenceEngine", "init_inference"]

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


_log = get_logger("engine")


class InferenceEngine(nn.Module):
    """DeepSpeed's inference engine over minispeed's fused model (see the module docstring).

    Holds no weights of its own: `fused` shares them with `module` (fp32) or keeps their int8
    copies; the cost is `minispeed.inference.init_inference`'s."""

    def __init__(self, module: nn.Module, fused: nn.Module | None, report: Any) -> None:
        super().__init__()
        self.module = module
        self.fused = fused
        self.injection_report = report
        self._hf = _is_transformers_model(module)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The fused model's logits for token ids; for a transformers model, in its output
        class (`.logits`). Arguments the fused model does not take (an attention mask with
        zeros, `labels`, `past_key_values`, ...) run the model itself, as does a model nothing
        was fused for (`fused` None)."""
        if self.fused is None:
            return self.module(*inputs, **kwargs)
        if not self._hf:
            return self.fused(*inputs, **kwargs)
        ids = inputs[0] if inputs else kwargs.get("input_ids")
        rest = {k: v for k, v in kwargs.items() if k != "input_ids"}
        mask = rest.pop("attention_mask", None)
        plain = mask is None or bool(torch.as_tensor(mask).bool().all())
        for name, harmless in _HARMLESS.items():  # what the fused logits answer as asked
            if name in rest and (rest[name] is None or rest[name] in harmless):
                del rest[name]
        if len(inputs) <= 1 and plain and isinstance(ids, torch.Tensor) and not rest:
            from transformers.modeling_outputs import CausalLMOutputWithPast

            return CausalLMOutputWithPast(logits=self.fused(ids))
        return self.module(*inputs, **kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' `generate(input_ids, ...)` (see the module docstring); a model that is
        not a transformers model uses `minispeed.inference.generate`."""
        if self.fused is None and hasattr(self.module, "generate"):
            return self.module.generate(*args, **kwargs)
        if not self._hf:
            raise TypeError(
                f"engine.generate is transformers' generate, and {type(self.module).__name__} "
                "is not a transformers model: use minispeed.inference.generate(engine.fused, "
                "prompts, SamplingConfig(...))"
            )
        return inference.hf_generate(self.fused, self.module, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = super().__getattr__("module")
            fused = super().__getattr__("fused")
            for owner in (module, fused):
                if hasattr(owner, name):
                    return getattr(owner, name)
            raise


# forward's keyword arguments the fused logits satisfy at these values
_HARMLESS: dict[str, tuple[bool, ...]] = {
    "return_dict": (True,),
    "use_cache": (True, False),
    "output_attentions": (False,),
    "output_hidden_states": (False,),
}


def _is_transformers_model(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def init_inference(model: nn.Module, config: Any = None, **kwargs: Any) -> InferenceEngine:
    """The inference engine for `model` (DeepSpeed's call; see the module docstring).

    Collective when `tensor_parallel.tp_size > 1` (every rank of the group calls it).
    Costs: those of `minispeed.inference.init_inference` (fp32 shares the model's weights;
    int8 stores about a quarter of the block weights', embedding's and head's bytes).
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
    size = tp.get("tp_size", 1) if isinstance(tp, Mapping) else getattr(tp, "tp_size", 1)
    if size == 1:  # DeepSpeed's `tensor_parallel={"tp_size": 1}`: no split, as if not given
        tp = None
    kernel_inject = bool(options.get("replace_with_kernel_inject", False))
    if tp and (not inference.is_recognised(model) or not kernel_inject):
        return _split_by_structure(model, dtype, tp)
    if not inference.is_recognised(model) and dtype == torch.float32 and not tp:
        _log.warning(
            "init_inference: no injection policy recognises %s (minispeed fuses GPT-2, LLaMA "
            "and its own GPT): it runs as written, without fused kernels",
            type(model).__name__,
        )
        return InferenceEngine(model, None, None)
    fused, report = inference.init_inference(
        model,
        dtype=dtype,
        replace_with_kernel_inject=kernel_inject,
        tensor_parallel=tp or None,
    )
    return InferenceEngine(model, fused, report)


def _split_by_structure(model: nn.Module, dtype: torch.dtype, tp: Any) -> InferenceEngine:
    """DeepSpeed's AutoTP: `tensor_parallel` on a model no policy fuses, or without
    `replace_with_kernel_inject`: the model cut in place by its structure
    (`minispeed.inference.split_by_structure`), run by its own forward and `generate`, whole
    logits on every rank. Collective over the tensor group."""
    if dtype != torch.float32:
        raise NotImplementedError(
            f"init_inference(dtype={dtype}) with tensor_parallel on {type(model).__name__}, "
            "split by its structure (no fused kernels): minispeed's int8 weights need the fused "
            "blocks (GPT-2, LLaMA and its own GPT with replace_with_kernel_inject=True); use "
            "dtype=torch.float32"
        )
    cfg = tp if isinstance(tp, inference.TPConfig) else inference.TPConfig.from_section(tp)
    split = inference.split_by_structure(model, cfg)
    report = inference.InjectionReport("autotp", split, (), dtype, cfg.tp_size)
    return InferenceEngine(model, None, report)
