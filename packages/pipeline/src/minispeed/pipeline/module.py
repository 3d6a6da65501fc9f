"""A model described as a list of layer specs, of which each rank builds only its own stage.

```python
layers = [
    TiedLayerSpec(nn.Embedding, (vocab, d), key="embed"),                    # stage 0
    *[LayerSpec(Block, (d,)) for _ in range(8)],
    TiedLayerSpec(nn.Embedding, (vocab, d), key="embed", forward_fn=lm_head),  # last stage
]
module = pipeline.partition(layers, stages=2, loss_fn=F.cross_entropy, method="type:Block")
```

(`lm_head(emb, h)` is e.g. `h @ emb.weight.T`; `test_module_docstring.py` runs this example.)
Each layer takes one argument (the previous layer's output: a tensor or a tuple) and returns one.
Layer i is built under `torch.manual_seed(seed + i)`, so a rank that builds layers 4..7 gets the
same weights as `build_unsplit` does on one process: the unsplit model is the reference the
tests compare with. Whatever the seed, the data-parallel replicas of a stage then take the
parameters of the replica of data rank 0 (one broadcast per parameter, at build), so ranks whose
RNGs differ (`seed=None`, DeepSpeed's `seed_layers: false`) still start equal. A tied layer is
built once per stage that holds it (under the seed of its first occurrence); its copies start
equal (broadcast from the lowest holding stage) and stay equal because their gradients are
summed over the holders before every step (`reduce_tied_grads`), which is exactly the gradient
of the one shared weight.

Memory per rank: the parameters of its own layers only, plus one copy of each tied layer it
holds; nothing of the other stages is ever allocated (parameter counts for the `parameters`
partition are taken on the `meta` device).
"""

from __future__ import annotations

import contextlib
import itertools
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.pipeline import partitioning, split_backward, status

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec", "build_unsplit", "layer_boundaries"]


@dataclass(frozen=True)
class LayerSpec:
    """A layer not yet built: `cls(*args, **kwargs)`. `cls` may also be any callable returning
    an `nn.Module` or a plain function of one argument (a parameter-free layer)."""

    cls: Callable[..., Any]
    """Layer class (or factory)."""
    args: tuple = ()
    """Positional constructor arguments."""
    kwargs: dict = field(default_factory=dict)
    """Keyword constructor arguments."""

    def __post_init__(self) -> None:
        # DeepSpeed's LayerSpec(typename, *args, **kwargs) and TiedLayerSpec(key, typename, ...)
        # put the arguments loose: caught here, not as a TypeError deep inside build()
        what = type(self).__name__
        if isinstance(self.cls, str) or not callable(self.cls):
            raise TypeError(
                f"{what} takes the layer class (or factory) first, got {self.cls!r}; write "
                f"{what}(nn.Embedding, (vocab, d){', key=...' if what != 'LayerSpec' else ''}) "
                "(DeepSpeed's order, with the tie key first and loose arguments, differs)"
            )
        if not isinstance(self.args, tuple) or not isinstance(self.kwargs, dict):
            raise TypeError(
                f"{what}({self.name}, ...): the constructor arguments go in one tuple and the "
                f"keyword arguments in one dict, e.g. {what}(nn.Linear, (d, d), {{'bias': False}}); "
                f"got args={self.args!r}, kwargs={self.kwargs!r}"
            )

    @property
    def name(self) -> str:
        """Class name, matched by the `type:<regex>` partition."""
        return getattr(self.cls, "__name__", type(self.cls).__name__)

    def build(self) -> Any:
        """Construct the layer."""
        return self.cls(*self.args, **self.kwargs)


@dataclass(frozen=True)
class TiedLayerSpec(LayerSpec):
    """A layer whose weights are shared by every spec with the same `key` (e.g. the input
    embedding and the output projection). `forward_fn(module, x)` replaces `module(x)` where
    given, e.g. `lambda emb, h: h @ emb.weight.T` for the output head."""

    key: str = ""
    """Name of the tie; specs with equal keys share one set of weights."""
    forward_fn: Callable[[nn.Module, Any], Any] | None = None
    """How this occurrence uses the tied module (default: call it)."""
    tied_attrs: tuple[str, ...] | None = None
    """The parameters the stages holding a copy share (dotted names, DeepSpeed's
    `tied_weight_attr`); None: every parameter of the module. The others stay each copy's own:
    an embedding module with position embeddings tied to the head by its token table only."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.key:
            raise ValueError("TiedLayerSpec needs a non-empty key naming the tie: key='embed'")


def _seeded(seed: int | None, index: int) -> contextlib.AbstractContextManager:
    if seed is None:
        return contextlib.nullcontext()
    rng = torch.random.fork_rng(devices=[])

    class _Ctx:
        def __enter__(self) -> None:
            rng.__enter__()
            torch.manual_seed(seed + index)

        def __exit__(self, *exc: object) -> None:
            rng.__exit__(*exc)

    return _Ctx()


def _first_index(layers: Sequence[Any]) -> dict[str, int]:
    first: dict[str, int] = {}
    for i, spec in enumerate(layers):
        if isinstance(spec, TiedLayerSpec):
            first.setdefault(spec.key, i)
    return first


def layer_boundaries(layers: Sequence[Any], parts: int, method: str | Sequence[int]) -> list[int]:
    """Boundaries `[0, b1, ..., n]` cutting `layers` into `parts` stages by `method`
    (`"uniform"`, `"parameters"`, `"type:<regex>"` or explicit boundaries); see partitioning.py."""
    n = len(layers)
    if not isinstance(method, str):
        return partitioning.validate_boundaries(method, n, parts)
    if method == "uniform":
        return partitioning.uniform_boundaries(n, parts)
    if method == "parameters":
        weights = []
        for spec in layers:
            with torch.device("meta"):
                built = spec.build() if isinstance(spec, LayerSpec) else spec
            weights.append(
                float(sum(p.numel() for p in built.parameters()))
                if isinstance(built, nn.Module)
                else 0.0
            )
        return partitioning.balanced_boundaries(weights, parts)
    if method.startswith("type:"):
        names = [s.name if isinstance(s, LayerSpec) else type(s).__name__ for s in layers]
        weights = partitioning.type_weights(names, method[len("type:") :])
        if not any(weights):
            raise partitioning.PartitionError(
                f"partition method {method!r}: the regex matched no layer class (the classes "
                f"are {sorted(set(names))}); fix the regex (it is searched case-insensitively in "
                "each class name) or use 'parameters'"
            )
        return partitioning.balanced_boundaries(weights, parts, require_weight=True)
    raise partitioning.PartitionError(
        f"unknown partition method {method!r}; use 'uniform', 'parameters', 'type:<regex>' or a "
        "list of boundaries"
    )


class _Chunk(nn.Module):
    """Layers [start, stop) of the model: one virtual stage."""

    def __init__(self, start: int, entries: list[tuple[str, Any]]) -> None:
        super().__init__()
        self.start = start
        self.entries = (
            entries  # (kind, key or index): "layer" -> self.layers[str(i)], "tied" -> key
        )
        self.layers = nn.ModuleDict()


class PipelineModule(nn.Module):
    """The chunks of one pipeline rank: virtual stages `stage, stage + P, ...` of the model.

    Attributes a reader needs: `stage` (this rank's pipeline index), `stages` (P),
    `virtual_stages` (V), `boundaries` (layer cut of all P·V virtual stages), `chunks[c]` (the
    layers of virtual stage c·P + stage), `tied` (this rank's copy of each tied module it uses),
    `loss_fn` (run by the last virtual stage), `grid` (the pipe × data process grid).
    """

    def __init__(
        self,
        layers: Sequence[Any],
        *,
        stages: int,
        stage: int,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        method: str | Sequence[int] = "parameters",
        virtual_stages: int = 1,
        seed: int | None = 0,
        activation_checkpointing: bool = False,
        grid: comm.ProcessGrid | None = None,
    ) -> None:
        super().__init__()
        self.stages, self.stage, self.virtual_stages = stages, stage, virtual_stages
        self.loss_fn, self.grid, self.activation_checkpointing = (
            loss_fn,
            grid,
            activation_checkpointing,
        )
        self.num_layers = len(layers)
        self.boundaries: list[int] = []
        self.tied = nn.ModuleDict()
        self.tied_forward: dict[int, Callable | None] = {}
        self.chunks = nn.ModuleList()
        if grid is None:
            self._build(layers, method, seed)
        else:
            # Note: cutting and building are local and may fail on one rank only (a layer's
            # constructor, a bad method on one rank); the peers would wait in the first
            # collective below. Every rank learns of it first and raises (status.py).
            failure: Exception | None = None
            try:
                self._build(layers, method, seed)
            except Exception as exc:
                failure = exc
            names = "|".join(
                f"{s.name}:{s.key}" if isinstance(s, TiedLayerSpec) else _spec_name(s)
                for s in layers
            )
            status.agree_at_build(
                grid,
                failure,
                {
                    "stages": stages if isinstance(stages, int) else -1,
                    "the number of layers": len(layers),
                    "virtual_stages": virtual_stages,
                    "the layer classes and tie keys (CRC-32)": zlib.crc32(names.encode()),
                    "the partition boundaries (CRC-32)": zlib.crc32(str(self.boundaries).encode()),
                },
                "building the pipeline stages (pipeline.partition)",
            )
        self._tied_attrs = {
            s.key: s.tied_attrs for s in reversed(layers) if isinstance(s, TiedLayerSpec)
        }  # the first spec of each key wins, as for the module it builds
        self._tie_groups = self._make_tie_groups(layers) if grid is not None else {}
        self._sync_replicas()
        self._sync_tied_weights()

    def _build(self, layers: Sequence[Any], method: str | Sequence[int], seed: int | None) -> None:
        """Cut the layers and build this rank's chunks (local: no communication)."""
        stages, stage = self.stages, self.stage
        if not layers:
            raise partitioning.PartitionError("the model has no layers; pass a list of LayerSpec")
        if self.grid is not None and self.grid.size("pipe") != stages:
            raise ValueError(
                f"grid has {self.grid.size('pipe')} pipeline stages but stages={stages}"
            )
        if not 0 <= stage < stages:
            raise ValueError(f"stage {stage} outside [0, {stages})")
        self.boundaries = layer_boundaries(layers, stages * self.virtual_stages, method)
        first = _first_index(layers)
        for c in range(self.virtual_stages):
            v = c * stages + stage
            lo, hi = self.boundaries[v], self.boundaries[v + 1]
            chunk = _Chunk(lo, [])
            for i in range(lo, hi):
                spec = layers[i]
                if isinstance(spec, TiedLayerSpec):
                    if spec.key not in self.tied:
                        with _seeded(seed, first[spec.key]):
                            self.tied[spec.key] = spec.build()
                    chunk.entries.append(("tied", spec.key))
                    self.tied_forward[i] = spec.forward_fn
                else:
                    with _seeded(seed, i):
                        built = spec.build() if isinstance(spec, LayerSpec) else spec
                    if isinstance(built, nn.Module):
                        chunk.layers[str(i)] = built
                        chunk.entries.append(("layer", str(i)))
                    else:
                        chunk.entries.append(("fn", built))
            self.chunks.append(chunk)

    # -- running ----------------------------------------------------------------------------------
    def chunk_layers(self, c: int) -> Iterator[tuple[Callable[[Any], Any], list[nn.Parameter]]]:
        """Each layer of chunk `c` as (callable of one argument, its parameters)."""
        chunk = self.chunks[c]
        for offset, (kind, ref) in enumerate(chunk.entries):
            if kind == "layer":
                mod = chunk.layers[ref]
                yield mod, list(mod.parameters())
            elif kind == "tied":
                mod, fn = self.tied[ref], self.tied_forward[chunk.start + offset]
                yield (mod if fn is None else _bind(fn, mod)), list(mod.parameters())
            else:
                yield ref, []

    def forward(
        self, x: Any, chunk: int = 0, segments: list[split_backward.Segment] | None = None
    ) -> Any:
        """Run chunk `chunk` on `x` (`forward_chunk`) as a call of this module, as the executor
        does: See Note [a stage's forward is a call of its module]."""
        return self.forward_chunk(chunk, x, segments)

    # Note [a stage's forward is a call of its module]
    # The executor runs a chunk through `module(x, chunk=c)`, never `forward_chunk` directly, so
    # whatever the stage computes happens inside a call of this module: its layers', and the
    # work that belongs to no layer module, a plain-function layer (a `lambda` in the layer list)
    # and a tied layer's `forward_fn`. Whoever watches modules (forward hooks, the FLOPs
    # profiler, which counts only work done while a module of the model runs) sees the stage's
    # whole forward, as DeepSpeed's engine, which calls its `PipelineModule`, does. The loss is
    # the executor's, computed after the call. Cost: one `nn.Module.__call__` per chunk forward.

    def forward_chunk(
        self, c: int, x: Any, segments: list[split_backward.Segment] | None = None
    ) -> Any:
        """Run chunk `c` on `x`. With `segments` (the zero-bubble split backward), cut the graph
        at each layer's input and record the pieces there (see `split_backward.py`)."""
        if segments is not None:
            chunk = self.chunks[c]
            names = [
                f"{chunk.start + k} ({self._entry_name(chunk, e)})"
                for k, e in enumerate(chunk.entries)
            ]
            layers = ((f, p, n) for (f, p), n in zip(self.chunk_layers(c), names))
            return split_backward.forward_segmented(layers, x, segments)
        if self.activation_checkpointing and torch.is_grad_enabled():
            args = x if isinstance(x, tuple) else (x,)
            return torch.utils.checkpoint.checkpoint(
                self._run_chunk, c, isinstance(x, tuple), *args, use_reentrant=False
            )
        for layer, _ in self.chunk_layers(c):
            x = layer(x)
        return x

    def _entry_name(self, chunk: _Chunk, entry: tuple[str, Any]) -> str:
        kind, ref = entry
        if kind == "layer":
            return type(chunk.layers[ref]).__name__
        if kind == "tied":
            return f"tied {ref!r}"
        return getattr(ref, "__name__", type(ref).__name__)

    def _run_chunk(self, c: int, was_tuple: bool, *args: Any) -> Any:
        x: Any = args if was_tuple else args[0]
        for layer, _ in self.chunk_layers(c):
            x = layer(x)
        return x

    # -- tied layers ------------------------------------------------------------------------------
    def _make_tie_groups(self, layers: Sequence[Any]) -> dict[str, Any]:
        """One process group per (tie key, data-parallel [and tensor] index) holding ≥ 2 stages. Created by
        every rank in the same order (sorted keys, then data index), as new_group requires."""
        assert self.grid is not None
        holders: dict[str, set[int]] = {}
        for v in range(self.stages * self.virtual_stages):
            for i in range(self.boundaries[v], self.boundaries[v + 1]):
                if isinstance(layers[i], TiedLayerSpec):
                    holders.setdefault(layers[i].key, set()).add(v % self.stages)
        topo, mine = self.grid.topology, {}
        # one group per line along the pipe axis: every other coordinate (data, and tensor in
        # a 3D grid, whose ranks each hold their own slice of the tied weight) fixed
        others = [a for a in topo.axes if a != "pipe"]
        here = {a: self.grid.rank_in(a) for a in others}
        for key in sorted(holders):
            stages = sorted(holders[key])
            if len(stages) < 2:
                continue
            for coord in itertools.product(*(range(topo.dim(a)) for a in others)):
                at = dict(zip(others, coord))
                ranks = [self.grid.ranks[topo.get_rank(pipe=s, **at)] for s in stages]
                group = comm.new_group(ranks)
                if at == here and self.stage in stages:
                    mine[key] = (group, ranks)
        return mine

    def _sync_replicas(self) -> None:
        """Every data-parallel replica of this stage takes the parameters and buffers of the
        replica of data rank 0 (DeepSpeed's engine does the same at build): with `seed=None`
        each rank builds from its own RNG, and ranks seeded differently would otherwise train
        apart silently. Bytes sent once, at build: the stage's parameters and buffers
        (Ψ_stage · 4 in fp32), one broadcast each."""
        if self.grid is None or self.grid.size("data") == 1:
            return
        group, src = self.grid.group("data"), self.grid.group_ranks("data")[0]
        for t in [*self.parameters(), *self.buffers()]:
            comm.broadcast(t.data, src=src, group=group)

    def _shared(self, key: str) -> list[nn.Parameter]:
        """The parameters of tied module `key` that its holders share (`tied_attrs`)."""
        module, names = self.tied[key], self._tied_attrs.get(key)
        if names is None:
            return list(module.parameters())
        shared = []
        for name in names:
            try:
                shared.append(module.get_parameter(name))
            except AttributeError:
                have = [n for n, _ in module.named_parameters()]
                raise ValueError(
                    f"tied layer {key!r}: tied_attrs names {name!r}, which "
                    f"{type(module).__name__} does not have; its parameters are {have}"
                ) from None
        return shared

    def _sync_tied_weights(self) -> None:
        for key, (group, ranks) in sorted(self._tie_groups.items()):
            for p in self._shared(key):
                comm.broadcast(p.data, src=ranks[0], group=group)

    def reduce_tied_grads(self, stand_in: bool = False) -> Exception | None:
        """Sum each tied parameter's gradient over the stages that hold it. Bytes sent per tied
        parameter of W bytes: 2(t−1)/t · W over t holders (all-reduce).

        With `stand_in` (this rank failed earlier in the batch), or once reading a gradient
        fails, zeros of the same shape are all-reduced instead, from the same line, so the other
        holders are never left waiting; the error is returned, not raised (see the executor)."""
        err: Exception | None = None
        for key, (group, _) in sorted(self._tie_groups.items()):
            for p in self._shared(key):
                buf = None
                if not stand_in and err is None:
                    try:
                        if p.grad is None:
                            p.grad = torch.zeros_like(p)
                        buf = p.grad
                    except Exception as exc:
                        err = exc
                comm.all_reduce(torch.zeros_like(p) if buf is None else buf, group=group)
        return err

    def tied_grad_groups(self) -> list[tuple[nn.Parameter, Any, bool]]:
        """Each tied parameter this rank shares with other stages, as (this rank's copy, the
        process group of its holders at this data index, whether this stage is the lowest
        holder). For an optimizer that sums tied gradients itself instead of
        `reduce_tied_grads` (`sharded.py`), e.g. `minispeed.zero.ModelParallel(shared=...)`,
        and for a norm of the whole model that counts each tied parameter once (on its lowest
        holder)."""
        me = comm.get_rank()
        return [
            (p, group, ranks[0] == me)
            for key, (group, ranks) in sorted(self._tie_groups.items())
            for p in self._shared(key)
        ]


def _spec_name(spec: Any) -> str:
    return spec.name if isinstance(spec, LayerSpec) else type(spec).__name__


def _bind(fn: Callable, mod: nn.Module) -> Callable[[Any], Any]:
    def call(x: Any) -> Any:
        return fn(mod, x)

    return call


class _Unsplit(nn.Module):
    def __init__(self, layers: Sequence[Any], seed: int | None) -> None:
        super().__init__()
        first = _first_index(layers)
        self.tied, self.layers, self.calls = nn.ModuleDict(), nn.ModuleDict(), []
        for i, spec in enumerate(layers):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied:
                    with _seeded(seed, first[spec.key]):
                        self.tied[spec.key] = spec.build()
                mod = self.tied[spec.key]
                self.calls.append(mod if spec.forward_fn is None else _bind(spec.forward_fn, mod))
            else:
                with _seeded(seed, i):
                    built = spec.build() if isinstance(spec, LayerSpec) else spec
                if isinstance(built, nn.Module):
                    self.layers[str(i)] = built
                self.calls.append(built)

    def forward(self, x: Any) -> Any:
        for call in self.calls:
            x = call(x)
        return x


def build_unsplit(layers: Sequence[Any], seed: int | None = 0) -> nn.Module:
    """The whole model on one process, built exactly as the stages build their parts (same
    seeds, one shared module per tie): the reference a pipeline must match."""
    return _Unsplit(layers, seed)
