"""DeepSpeed's `PipelineModule(layers, num_stages, topology, loss_fn, seed_layers, ...)` over
`minispeed.pipeline.PipelineModule`.

```python
from minispeed.engine.pipe import LayerSpec, PipelineModule, TiedLayerSpec
model = PipelineModule(layers, num_stages=2, loss_fn=loss_fn, seed_layers=True)
```

What is DeepSpeed's here, and how:

- **Stages**: `num_stages` pipeline stages over a `("pipe", "data")` grid of the world
  (data-parallel neighbours adjacent, DeepSpeed's `PipeDataParallelTopology`), or the grid of a
  given `topology` (a `minispeed.comm.ProcessTopology`, or any object with DeepSpeed's
  `get_axis_names()` / `get_dim(axis)`, over the axes `pipe`, `data` and optionally a third,
  `tensor` (DeepSpeed's `model`), varying fastest: `PipeModelDataParallelTopology`). The
  stage's layers are built whole; `initialize` cuts them by the tensor-parallel plan
  (`minispeed.tensor_parallel.parallelize_everywhere`).
- **Partition**: DeepSpeed's own arithmetic (`partition.py`), passed to the package as explicit
  boundaries, so each stage holds the same layers as under DeepSpeed (`parts`).
- **Seeds**: `seed_layers=True` builds layer i under `base_seed + i` on whichever stage owns it,
  reseeds before each layer's forward as DeepSpeed does (`chunk_layers`), and leaves the global RNGs (torch, `random`, numpy) as DeepSpeed leaves them: seeded with
  `base_seed + i` of the stage's last layer, after building it (costs one extra build of that
  layer, freed at once). With `seed_layers=False` layers draw from the current RNG in DeepSpeed's
  order, including the `parameters` partition building every layer once to count its
  parameters (DeepSpeed's cost, kept so the weights that follow are DeepSpeed's); data-parallel
  replicas are made equal by the engine's broadcast, as DeepSpeed's engine does.
- **Tied layers**: built once per stage that holds them, equal across stages (broadcast from the
  lowest), gradients summed over the holders before each step.
- **No `loss_fn`**: the last layer's output is the loss, as in DeepSpeed ("some models just
  return loss from forward()"); the data iterator still yields `(inputs, labels)`.
- **Activation checkpointing**: any `activation_checkpoint_interval > 0` recomputes the stage's
  whole forward in its backward (the package checkpoints whole stages); the numbers are the
  same as DeepSpeed's per-interval checkpoints, the activation memory is one stage input per
  micro-batch instead of one per interval.

Refused, each by name: `seed_fn`, `activation_checkpoint_func`, `checkpointable_layers` and a
topology with other axes. A tie shares the parameters `tied_weight_attr` names (DeepSpeed's
default `"weight"`); the tied module's other parameters stay each stage copy's own, as in
DeepSpeed (an embedding with position embeddings tied to the head by its token table).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
import minispeed.pipeline as pipeline
from minispeed.engine.pipe import partition

__all__ = ["PipelineModule"]


def _set_random_seed(seed: int) -> None:
    """DeepSpeed's `runtime.utils.set_random_seed`: python's, numpy's and torch's RNGs."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _output_is_the_loss(outputs: Any, labels: Any) -> Any:
    """DeepSpeed without `loss_fn`: the last layer's output is the loss (labels are unused)."""
    return outputs


def _reseeding(layer: Callable[[Any], Any], seed: int) -> Callable[[Any], Any]:
    def call(x: Any) -> Any:
        _set_random_seed(seed)
        return layer(x)

    return call


def _topology(num_stages: int | None, topology: Any) -> comm.ProcessTopology:
    if topology is None:
        if num_stages is None:
            raise ValueError("PipelineModule needs num_stages or topology; give one of them")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
        world = comm.get_world_size()
        if world % num_stages:
            raise ValueError(
                f"num_stages ({num_stages}) must divide the world size ({world}); the rest of "
                "the world is data parallelism"
            )
        return comm.ProcessTopology(("pipe", "data"), (num_stages, world // num_stages))
    if isinstance(topology, comm.ProcessTopology):
        axes, dims = topology.axes, topology.dims
    elif hasattr(topology, "get_axis_names") and hasattr(topology, "get_dim"):
        axes = tuple(topology.get_axis_names())
        dims = tuple(int(topology.get_dim(a)) for a in axes)
    else:
        raise TypeError(
            f"topology must be a minispeed.comm.ProcessTopology (axes pipe, data), got "
            f"{type(topology).__name__}"
        )
    # DeepSpeed's PipeModelDataParallelTopology names the tensor axis "model"
    axes = tuple("tensor" if a == "model" else a for a in axes)
    if axes not in (("pipe", "data"), ("pipe", "data", "tensor")):
        raise NotImplementedError(
            f"topology axes {list(axes)}: minispeed's PipelineModule runs on ('pipe', 'data') "
            "or ('pipe', 'data', 'tensor') (tensor fastest: PipeModelDataParallelTopology)"
        )
    if num_stages is not None and num_stages != dims[0]:
        raise ValueError(f"num_stages={num_stages} but the topology has {dims[0]} pipe stages")
    return comm.ProcessTopology(axes, dims)


class PipelineModule(pipeline.PipelineModule):
    """DeepSpeed's `PipelineModule`: this rank's stage of `layers` (see the module docstring).

    Collective: every rank constructs it with the same arguments (it creates the grid's process
    groups and broadcasts tied weights). Bytes kept per rank: the parameters of its own layers
    plus one copy of each tied module it uses.
    """

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
    ) -> None:
        for name, value in (
            ("seed_fn", seed_fn),
            ("activation_checkpoint_func", activation_checkpoint_func),
            ("checkpointable_layers", checkpointable_layers),
        ):
            if value is not None:
                raise NotImplementedError(
                    f"PipelineModule({name}=...) is not supported by minispeed; leave it unset"
                )
        if (
            not isinstance(activation_checkpoint_interval, int)
            or activation_checkpoint_interval < 0
        ):
            raise ValueError(
                f"activation_checkpoint_interval must be an int >= 0, got "
                f"{activation_checkpoint_interval!r}"
            )
        layers = list(layers)
        topo = _topology(num_stages, topology)
        stages = topo.dim("pipe")
        bounds = partition.boundaries(
            layers, stages, partition_method, build_for_real=not seed_layers
        )
        pipeline.partitioning.validate_boundaries(bounds, len(layers), stages)
        grid = comm.ProcessGrid(topo)
        super().__init__(
            layers,
            stages=stages,
            stage=grid.rank_in("pipe"),
            loss_fn=_output_is_the_loss if loss_fn is None else loss_fn,
            method=bounds,
            seed=base_seed if seed_layers else None,
            activation_checkpointing=activation_checkpoint_interval > 0,
            grid=grid,
        )
        self.seed_layers, self.base_seed = seed_layers, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.dynamic_shape = dynamic_shape
        self.tied_weight_attrs = {
            s.key: list(getattr(s, "tied_weight_attr", ["weight"]))
            for s in layers
            if isinstance(s, pipeline.TiedLayerSpec)
        }
        self.micro_offset = 0  # forwards run by this stage (DeepSpeed's name)
        if seed_layers:
            self._leave_rng_as_deepspeed(layers)

    def _leave_rng_as_deepspeed(self, layers: list[Any]) -> None:
        """DeepSpeed seeds the global RNGs before each layer and does not restore them; the
        package builds under `fork_rng`. Replay the stage's last seeding and build, so code
        that draws random numbers after building the model draws DeepSpeed's."""
        lo, hi = self.boundaries[self.stage], self.boundaries[self.stage + 1]
        last = hi - 1
        _set_random_seed(self.base_seed + last)
        spec = layers[last]
        if isinstance(spec, pipeline.TiedLayerSpec):
            earlier = any(
                isinstance(x, pipeline.TiedLayerSpec) and x.key == spec.key for x in layers[lo:last]
            )
            if not earlier:
                spec.build()
        elif isinstance(spec, pipeline.LayerSpec):
            spec.build()

    # -- DeepSpeed's per-layer seeds in forward ---------------------------------------------------
    def chunk_layers(self, c: int) -> Iterator[tuple[Callable[[Any], Any], list[nn.Parameter]]]:
        """The package's layers of chunk `c`; with `seed_layers`, each reseeds the global RNGs
        before it runs as DeepSpeed's forward does: `base_seed · (n + 1) + i` for layer i in this
        stage's n-th forward (n counts every forward, training and evaluation). So layers that
        draw random numbers (dropout) draw DeepSpeed's. Not with activation checkpointing (see
        Note [no per-layer seeds under checkpointing])."""
        layers = super().chunk_layers(c)
        if not self.seed_layers or self.activation_checkpointing:
            yield from layers
            return
        start = self.chunks[c].start
        for offset, (layer, params) in enumerate(layers):
            if offset == 0:  # the first layer starts a forward of this stage
                self.micro_offset += 1
            yield (
                _reseeding(layer, self.base_seed * (self.micro_offset + 1) + start + offset),
                params,
            )

    # Note [no per-layer seeds under checkpointing]
    # The package recomputes a checkpointed stage in backward by calling chunk_layers again, long
    # after later micro-batches moved the forward count on; reseeding there would draw other
    # masks than the forward did and give wrong gradients. DeepSpeed captures the count in a
    # closure per forward; the package offers no such hook, so with activation checkpointing the
    # layers draw from the RNG as it runs (torch's checkpoint replays it in the recomputation).

    # -- DeepSpeed's names ------------------------------------------------------------------------
    @property
    def parts(self) -> list[int]:
        """Layer boundaries of the stages: stage s holds layers `[parts[s], parts[s + 1])`."""
        return list(self.boundaries)

    @property
    def stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.stage

    @property
    def num_stages(self) -> int:
        """Pipeline stages P."""
        return self.stages

    def num_pipeline_stages(self) -> int:
        """Pipeline stages P (DeepSpeed's method)."""
        return self.stages

    def topology(self) -> comm.ProcessTopology:
        """The `("pipe", "data"[, "tensor"])` topology the stages run on."""
        assert self.grid is not None
        return self.grid.topology

    def partitions(self) -> list[int]:
        """Same as `parts` (DeepSpeed's method)."""
        return self.parts
