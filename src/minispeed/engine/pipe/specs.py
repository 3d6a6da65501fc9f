"""DeepSpeed's `LayerSpec` and `TiedLayerSpec` signatures over `minispeed.pipeline`'s specs.

DeepSpeed writes `LayerSpec(cls, *args, **kwargs)` and `TiedLayerSpec(key, cls, *args,
forward_fn=None, tied_weight_attr="weight", **kwargs)`; minispeed.pipeline's specs are frozen
dataclasses `LayerSpec(cls, args, kwargs)` and `TiedLayerSpec(cls, args, kwargs, key,
forward_fn)`. These subclasses take DeepSpeed's arguments and are the package's specs, so
`minispeed.pipeline.PipelineModule` builds them unchanged. DeepSpeed's attribute names
(`typename`, `module_args`, `module_kwargs`) read the same fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

import minispeed.pipeline as pipeline

__all__ = ["LayerSpec", "TiedLayerSpec"]


def _require_module_class(typename: Any) -> None:
    # DeepSpeed raises here too ('LayerSpec only supports torch.nn.Module types'): a plain
    # function goes into the layer list as it is, not inside a spec.
    if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
        raise TypeError(
            f"LayerSpec only supports torch.nn.Module classes, got {typename!r}; put a plain "
            "function (e.g. a lambda) in the layer list directly, without a LayerSpec"
        )


class LayerSpec(pipeline.LayerSpec):
    """`LayerSpec(typename, *module_args, **module_kwargs)`: a layer built as
    `typename(*module_args, **module_kwargs)` only on the stage that owns it (DeepSpeed's
    signature; see `minispeed.pipeline.LayerSpec`)."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        _require_module_class(typename)
        pipeline.LayerSpec.__init__(self, typename, module_args, dict(module_kwargs))

    @property
    def typename(self) -> type[nn.Module]:
        """The layer class (DeepSpeed's name for `cls`)."""
        return self.cls

    @property
    def module_args(self) -> tuple:
        """Positional constructor arguments."""
        return self.args

    @property
    def module_kwargs(self) -> dict:
        """Keyword constructor arguments."""
        return self.kwargs


class TiedLayerSpec(pipeline.TiedLayerSpec):
    """`TiedLayerSpec(key, typename, *module_args, forward_fn=None, tied_weight_attr="weight",
    **module_kwargs)`: every spec with the same `key` shares one module's weights (DeepSpeed's
    signature). `forward_fn(module, x)` replaces `module(x)` where given (e.g. an output head
    reading the embedding's weight).

    `tied_weight_attr` (a name or a list, dotted paths allowed) names the parameters the stages
    holding a copy share (`minispeed.pipeline.TiedLayerSpec.tied_attrs`); the module's other
    parameters stay each copy's own, as in DeepSpeed.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        _require_module_class(typename)
        attrs = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        pipeline.TiedLayerSpec.__init__(
            self, typename, module_args, dict(module_kwargs), key, forward_fn, tuple(attrs)
        )
        object.__setattr__(self, "tied_weight_attr", attrs)  # frozen dataclass: see specs above

    typename = LayerSpec.typename
    module_args = LayerSpec.module_args
    module_kwargs = LayerSpec.module_kwargs
