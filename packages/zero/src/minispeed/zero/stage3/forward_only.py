"""Stage 3 without an optimizer: the parameter shards, gathered for forward, and nothing else.

```python
import minispeed.zero as zero
shards = zero.shard(model, None, zero.ZeroConfig(stage=3),
                    precision=zero.MixedPrecision(param_dtype=torch.bfloat16))
with torch.no_grad():
    logits = model(tokens)          # each module's parameters gathered around its forward
shards.close()                      # collective: the model whole again on every rank
```

This is ZeRO-Inference (DeepSpeed's ``deepspeed.initialize(model=..., config=...)`` at stage 3
with no optimizer): running a model larger than one device by keeping ``1/N`` of it per rank.
`zero.shard` builds the same stage 3 as for training (`assemble`, stage3/assemble.py: the
partitions, the persistent parameters, the fetch units and their hooks, prefetch, ZeRO++,
MiCS, ``offload_param`` cpu or nvme), over an empty list of trained parameters, so that
nothing of the optimizer's side is made. Note [stage 3 without an optimizer].

Costs per rank (Ψ parameters, N ranks, p bytes per element of ``param_dtype``, Ψ_pers the
persistent elements; `memory.formulas.forward_only_state_bytes`, which `zero.measure`'s
`predict` calls):

| | forward only (this) | an SGD of learning rate 0 over stage 3 (what the engine did before) |
|---|---|---|
| parameter shards | ``p·Σ ceil(n/N)`` ≈ ``p·Ψ/N`` | the same |
| persistent parameters | ``p·Ψ_pers·(1 + 1/N)`` | the same |
| fp32 masters | 0 | ``4·Ψ/N`` (16-bit: a copy of its own; fp32: the shard itself) |
| gradient shards | 0 (no hooks) | ``g·Ψ/N`` from each backward to its step |
| optimizer state | 0 | 0 (SGD without momentum) |
| **bf16 / fp16** | ``2Ψ/N`` | ``6Ψ/N``: three times as much |

plus what is gathered at the moment (the running module's parameters and the prefetch window,
``stage3_max_live_numel``), as under training. Bytes sent per forward: one all-gather of every
non-persistent parameter, ``Σ N·ceil(n/N)·p`` (message; stage3/ledger.py), and the trace's
cross-rank check (a few bytes per pass, trace.py); no reduce-scatter ever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minispeed.zero.config import ZeroConfig
from minispeed.zero.contract import StrategyWrapper, weak_hook
from minispeed.zero.lifetime import Detachable
from minispeed.zero.precision import MixedPrecision
from minispeed.zero.stage3.params import ShardedParam

__all__ = ["ForwardOnly", "check_forward_only", "model_precision"]

# Note [stage 3 without an optimizer]
# Training's stage 3 keeps, beside each 16-bit shard, an fp32 master of it (the optimizer
# steps the masters and writes them back into the shards) and, from backward to the step, an
# fp32 gradient shard. A model that only runs forward needs neither: its shards are its
# values. `assemble` gives a master and a gradient hook only to the parameters of the
# optimizer's param groups (`trained`), so with no param groups it builds neither, and
# `offload_params` gives none to the shards it moves. What a rank keeps is then the shards
# alone, in ``param_dtype``. Nothing here can step, so a gradient is refused where it
# appears: `backward` and `step` raise, and ``loss.backward()`` on the model raises from the
# first parameter gradient (before it is kept: a released parameter's full gradient would
# otherwise stay in ``param.grad``, Ψ·p bytes across the model). Gradients of the inputs
# alone (``torch.autograd.grad(out, inputs)``) run as under training: stage 3 gathers each
# module again for its backward.

# Note [ZeRO++ without an optimizer]
# Of ZeRO++'s three, only qwZ acts on a forward: each gather sends int8 blocks of the shards
# (about 4x fewer bytes than fp32), so a forward-only model computes with the dequantized
# weights, within max|block|/254 of the true ones per element (stage3/zeropp.py), exactly as
# a training forward under qwZ does. hpZ allocates a secondary shard of every non-persistent
# parameter at shard() ((N/k)·s·p bytes per rank each, N/k times the primary shard) and
# writes it at each forward gather, for backward's node-local gather only; qgZ changes how
# gradients are reduced. Without an optimizer neither can do anything but cost, so both are
# refused here, naming the key; the engine leaves them out of a training config used for
# inference, as it leaves out offload_optimizer (steps.shard_forward_only). MiCS (its shard
# group gathers, its replicas hold copies) and a tensor-parallel grid (the data group of the
# grid, each rank sharding its own tensor slice) run as under training.


class ForwardOnly(Detachable):
    """What ``zero.shard(model, None, config)`` returns: stage 3's shards, no optimizer side.

    Holds the `Stage3Strategy` (``strategy``; `MicsStrategy` under MiCS) and its hooks on the
    model. ``optimizer`` is None: there is no optimizer. `backward` and `step` raise; a
    parameter gradient computed by ``loss.backward()`` raises. `close` (collective) hands the
    model back whole. Bytes kept: the module docstring's table (`zero.measure(shards, model)`
    counts them, `zero.memory.predict` gives the formula's).
    """

    optimizer = None  # no optimizer (zero.measure and zero.memory.predict read this)

    def __init__(
        self,
        strategy: Any,
        config: ZeroConfig,
        precision: MixedPrecision,
        group: Any,
        *,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.strategy = strategy
        self.config, self.precision, self.comm_group = config, precision, group
        self._on_close = on_close
        self._closed = False
        # Weak: Note [hooks hold their owner weakly] (contract.py).
        self._hooks = [
            sp.param.register_post_accumulate_grad_hook(weak_hook(self._refuse_gradient))
            for sp in self.sharded_params()
            if sp.param.requires_grad
        ]

    def sharded_params(self) -> list[ShardedParam]:
        """Every ShardedParam of the model, in ``named_parameters()`` order."""
        return self.strategy.sharded_params()

    def fragments(self) -> list[Any]:
        """No master fragments: nothing is stepped (checkpoints of optimizer state have none)."""
        return []

    # -- refused ----------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Refused: nothing here keeps or reduces gradients."""
        raise RuntimeError(self._why("backward()"))

    def step(self) -> None:
        """Refused: there is no optimizer to step."""
        raise RuntimeError(self._why("step()"))

    def _refuse_gradient(self, param: nn.Parameter) -> None:
        """A parameter's gradient was accumulated (``loss.backward()``): drop it, end stage 3's
        backward pass (its parameters released), raise. See Note [stage 3 without an optimizer]."""
        param.grad = None
        _stage(self.strategy).coordinator.end_backward()
        name = next((sp.name for sp in self.sharded_params() if sp.param is param), "?")
        raise RuntimeError(self._why(f"a backward that reaches parameter {name!r}"))

    def _why(self, what: str) -> str:
        return (
            f"{what} on zero.shard(model, None, ...): stage 3 without an optimizer keeps the "
            f"parameter shards only (no fp32 masters, no gradients). To train, pass an optimizer: "
            f"zero.shard(model, torch.optim.AdamW(model.parameters()), config) (deepspeed."
            f"initialize(..., optimizer=...) or an `optimizer` section); for gradients of the "
            f"inputs only, set requires_grad_(False) on the parameters"
        )

    # -- lifetime (lifetime.py) ------------------------------------------------------------------
    def close(self) -> None:
        """Gather every parameter back into the model and remove every hook (idempotent).

        Collective: one all-gather of every released parameter, after which each rank holds
        the full parameters (``Ψ·p`` bytes); with offload_param nvme the swap files go.
        """
        Detachable.close(self)

    def _detach(self) -> None:
        self.strategy.close()

    def __repr__(self) -> str:
        return (
            f"ForwardOnly(stage 3, {len(self.sharded_params())} parameters, "
            f"dtype={self.precision.param_dtype}, closed={self._closed})"
        )


def model_precision(model: nn.Module) -> MixedPrecision:
    """Forward only, no precision given: the one floating dtype of `model`'s parameters."""
    params = (
        model.parameters() if isinstance(model, nn.Module) else ()
    )  # else: zero.shard refuses it
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    if len(dtypes) > 1:
        raise ValueError(
            f"zero.shard(model, None) keeps the model's dtype, but its parameters have several "
            f"({', '.join(sorted(map(str, dtypes)))}): pass precision=zero.MixedPrecision("
            f"param_dtype=...) to choose the one every shard is kept in"
        )
    return MixedPrecision(param_dtype=dtypes.pop() if dtypes else torch.float32)


def check_forward_only(config: ZeroConfig, **refused: Any) -> None:
    """`shard(model, None, ...)`: stage 3, and nothing that only an optimizer (or a backward)
    would use: offload_optimizer, hpZ, qgZ (Note [ZeRO++ without an optimizer])."""
    if config.stage != 3:
        raise ValueError(
            f"zero.shard(model, None) needs stage 3 (got {config.stage}): without an optimizer "
            f"only stage 3 changes anything, keeping 1/N of the parameters per rank; stages 0-2 "
            f"would keep the whole model on every rank (run it as it is), or pass an optimizer"
        )
    if config.offload_optimizer is not None:
        raise ValueError(
            "zero.shard(model, None) has no optimizer state for offload_optimizer to move: "
            "remove it (offload_param still moves the parameter shards), or pass an optimizer"
        )
    # Note [ZeRO++ without an optimizer]
    if config.hpz_partition_size > 1:
        raise ValueError(
            f"zero.shard(model, None) with hpz_partition_size={config.hpz_partition_size}: hpZ "
            f"keeps a secondary copy of every sharded parameter, N/k times a shard per rank, for "
            f"backward's gathers alone, and forward only runs no backward, so the copy would be "
            f"memory spent for nothing; set hpz_partition_size (zero_hpz_partition_size) to 1 "
            f"(quantized_weights still shrinks the forward's gathers), or pass an optimizer"
        )
    if config.quantized_gradients:
        raise ValueError(
            "zero.shard(model, None) with quantized_gradients: qgZ quantizes the reduction of "
            "gradients, and forward only has none; set quantized_gradients "
            "(zero_quantized_gradients) to false, or pass an optimizer"
        )
    for name, value in refused.items():
        if value is not None:
            raise NotImplementedError(
                f"zero.shard(model, None, {name}=...) is not supported: {name} only changes "
                f"how gradients are reduced and clipped, and forward only has none; leave it out"
            )


def _stage(strategy: Any) -> Any:
    """The `Stage3Strategy` under MiCS's wrapper."""
    return strategy.stage if isinstance(strategy, StrategyWrapper) else strategy
