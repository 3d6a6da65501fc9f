"""`parallelize(model, plan, group)`: apply a tensor-parallel plan to a model, in place.

A `Plan` maps module paths (globs: `blocks.*.attn.qkv`) to a style each (see `styles`), and
names the counts the group size must divide (heads, kv heads, MLP width, vocabulary). Applying
it, in order, with every check before any module changes (so a refused plan leaves the model
whole, and every rank, running the same checks on the same model, raises the same error without
talking):

1. the size divides every count of the plan (the error names the count and the sizes that fit);
2. every pattern matches a module (the error names the pattern and the closest paths), no
   module is matched by two patterns, and each module can take its style (its type; the size
   divides the dimension cut; `Heads` names integer attributes the size divides);
3. no module was parallelized before (a layer applied twice would be split twice);
4. a weight shared by two modules (a tied embedding and output head) is split the same way in
   both: both planned, both cut along the vocabulary;
5. then each module is replaced (column, row, vocab) or given its hooks; tied weights end up
   sharing one slice.

The composition order (docs/architecture.md): pipeline partition, then this, then the optimizer and
`zero.shard` over the data axis: the optimizer sees the slices.
"""

from __future__ import annotations

import copy
import difflib
import fnmatch
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.tensor_parallel.group import TensorGroup
from minispeed.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    source_layout,
)
from minispeed.tensor_parallel.mappings import (
    copy_to_parallel,
    gather_from_sequence,
    scatter_to_sequence,
)
from minispeed.tensor_parallel.sharding import ShardSpec
from minispeed.tensor_parallel.styles import (
    Column,
    HeadInput,
    HeadNorm,
    Heads,
    Row,
    ScatterSequence,
    SequenceShard,
    Style,
    Vocab,
)

__all__ = ["Plan", "check_divides", "parallelize"]

_SPLIT = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
# Modules a plan has touched (hooks, divided head counts): a registry, not attributes patched
# onto the user's modules. Weak, so it holds no model alive.
_APPLIED: weakref.WeakKeyDictionary[nn.Module, Style] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Plan:
    """Module path globs -> style, and the counts the tensor-parallel size must divide."""

    styles: dict[str, Style]
    """Ordered: `fnmatch` globs over `named_modules()` paths, one style each."""
    divides: dict[str, int] = field(default_factory=dict)
    """e.g. `{"heads (n_head)": 12, "vocabulary (vocab_size)": 50304}`."""


def check_divides(size: int, counts: dict[str, int], label: str = "tensor-parallel size") -> None:
    """Raise a `ValueError` naming each count `size` does not divide, and the sizes that would."""
    bad = {name: v for name, v in counts.items() if v % size}
    if not bad:
        return
    name, value = next(iter(bad.items()))
    fits = [d for d in range(1, value + 1) if all(v % d == 0 for v in counts.values())]
    raise ValueError(
        f"{label}={size} does not divide the model's {name} ({value})"
        + "".join(f", nor its {k} ({v})" for k, v in list(bad.items())[1:])
        + f": each rank must hold whole heads and an equal share; pick a size among {fits}"
    )


def _match(model: nn.Module, plan: Plan) -> dict[str, tuple[str, Style]]:
    paths = [p for p, _ in model.named_modules() if p]
    matched: dict[str, tuple[str, Style]] = {}
    for pattern, style in plan.styles.items():
        hits = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.5)
            hint = f"; closest paths: {close}" if close else f"; paths look like {paths[:4]}"
            raise ValueError(f"tensor-parallel plan: {pattern!r} matches no module{hint}")
        for p in hits:
            if p in matched:
                raise ValueError(
                    f"tensor-parallel plan: module {p!r} is matched by both {matched[p][0]!r} and "
                    f"{pattern!r}; give each module one style"
                )
            matched[p] = (pattern, style)
    return matched


def _check_fresh(model: nn.Module, matched: dict[str, tuple[str, Style]]) -> None:
    for path, m in model.named_modules():
        if path in matched and (isinstance(m, _SPLIT) or m in _APPLIED):
            raise ValueError(
                f"module {path!r} is already tensor-parallel ({type(m).__name__}): "
                "parallelize was applied twice; apply the plan once, to the unsplit model"
            )


def _check_modules(model: nn.Module, matched: dict[str, tuple[str, Style]], n: int) -> None:
    """Each module can take its style at this size: its type, the dimension it is cut along,
    the attributes `Heads` divides. Checked for all before any module changes."""
    for path, (pattern, style) in matched.items():
        m = model.get_submodule(path)
        where = f"tensor-parallel plan: {path!r} (matched by {pattern!r})"
        if isinstance(style, Column | Row):
            try:
                weight, _, transposed = source_layout(m)
            except TypeError as err:
                raise ValueError(f"{where}: {err}") from None
            if isinstance(style, Column):
                dim = 1 if transposed else 0
                ShardSpec(dim, style.parts).check(weight.shape[dim], n, f"{where} output features")
            else:
                dim = 0 if transposed else 1
                ShardSpec(dim).check(weight.shape[dim], n, f"{where} input features")
        elif isinstance(style, Vocab):
            if not isinstance(m, nn.Embedding):
                raise ValueError(
                    f"{where}: vocabulary parallelism takes an nn.Embedding, not {type(m).__name__}"
                )
            ShardSpec(0).check(m.num_embeddings, n, f"{where} vocabulary")
        elif isinstance(style, Heads):
            for attr in style.attrs:
                value = _get_dotted(m, attr)
                if not isinstance(value, int) or value % n:
                    raise ValueError(
                        f"{where}: Heads divides the integer attribute {attr!r} by {n}, but it is "
                        f"{value!r}; name an attribute the attention reshapes by"
                    )


def _check_tied(model: nn.Module, matched: dict[str, tuple[str, Style]]) -> None:
    """A weight shared by modules must be cut the same way in each (vocab = column rows)."""
    owners: dict[int, list[str]] = {}
    for path, m in model.named_modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(path)
    for paths in owners.values():
        if len(paths) < 2:
            continue
        cuts = {}
        for p in paths:
            style = matched.get(p, (None, None))[1]
            # an embedding's rows and a linear head's output rows are the same cut: the vocabulary
            cuts[p] = "vocabulary rows" if isinstance(style, Vocab | Column) else style
        kinds = set(map(str, cuts.values()))
        if len(kinds) > 1:
            desc = ", ".join(
                f"{p!r} as {type(s).__name__ if not isinstance(s, str) else s}"
                if s is not None else f"{p!r} not split"
                for p, s in cuts.items()
            )  # fmt: skip
            raise ValueError(
                f"tensor-parallel plan: a tied weight is shared by {paths} but split differently "
                f"({desc}); split the embedding as Vocab() and its head as Column() (or neither)"
            )


def _get_dotted(obj: Any, attr: str) -> Any:
    for part in attr.split("."):
        obj = getattr(obj, part, None)
    return obj


def _own_copy(obj: Any, name: str) -> Any:
    """`obj.name` replaced by a shallow copy of it (so dividing its counts leaves the object
    other modules share, such as the model's config, whole); returns the copy."""
    mine = copy.copy(getattr(obj, name))
    setattr(obj, name, mine)
    return mine


def _keep_heads(names: tuple[str, ...], local: int, tg: TensorGroup, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:  # fmt: skip
    """`styles.Heads.per_head_kwargs`: this rank's `local` heads of each `(B·H, ...)` tensor."""
    for name in names:
        if name not in kwargs:
            raise RuntimeError(
                f"tensor-parallel plan: {type(module).__name__} was called without the keyword "
                f"argument {name!r} whose heads the plan keeps (Heads.per_head_kwargs); pass it "
                "by keyword, or plan the module by hand"
            )
        t = kwargs[name]
        if t is not None:  # (B·H, ...) -> (B, n, H/n, ...) -> this rank's (B·H/n, ...)
            kwargs[name] = t.unflatten(0, (-1, tg.size, local))[:, tg.rank].flatten(0, 1)
    return args, kwargs


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, name, new)


def _sum_grad_hook(tg: TensorGroup):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=tg.group)
        return grad

    return hook


def _apply(model: nn.Module, path: str, style: Style, tg: TensorGroup, tied: dict[int, nn.Parameter]) -> None:  # fmt: skip
    m = model.get_submodule(path)
    if isinstance(style, Column | Row | Vocab):
        cls = {Column: ColumnParallelLinear, Row: RowParallelLinear, Vocab: VocabParallelEmbedding}
        options = {k: getattr(style, k) for k in style.__dataclass_fields__}
        new = cls[type(style)].from_module(m, tg, **options)
        key = id(m.weight)
        if key in tied:  # the other end of a tied pair was split first: share its slice
            new.weight = tied[key]
        tied[key] = new.weight
        _replace(model, path, new)
        return
    if isinstance(style, Heads):
        for attr in style.attrs:  # checked by _check_modules
            owner_path, _, name = attr.rpartition(".")
            owner = m
            if owner_path:  # a shallow copy for this module alone (styles.Heads)
                for part in owner_path.split("."):
                    owner = _own_copy(owner, part)
            setattr(owner, name, getattr(owner, name) // tg.size)
        if style.per_head_kwargs and tg.size > 1:
            local = _get_dotted(m, style.attrs[0])
            m.register_forward_pre_hook(
                functools.partial(_keep_heads, style.per_head_kwargs, local, tg), with_kwargs=True
            )
    elif isinstance(style, ScatterSequence):
        m.register_forward_hook(lambda _m, _i, out: scatter_to_sequence(out, tg))
    elif isinstance(style, HeadInput):
        if style.sequence_parallel:
            m.register_forward_hook(lambda _m, _i, out: gather_from_sequence(out, tg))
        else:
            m.register_forward_hook(lambda _m, _i, out: copy_to_parallel(out, tg))
    sums_grads = isinstance(style, SequenceShard | HeadNorm) or (
        isinstance(style, HeadInput) and style.sequence_parallel
    )
    if sums_grads and tg.size > 1:
        for p in m.parameters():
            p.register_hook(_sum_grad_hook(tg))
    _APPLIED[m] = style


def parallelize(model: nn.Module, plan: Plan, group: Any) -> nn.Module:
    """Split `model` over the tensor-parallel `group` by `plan`, in place; returns `model`.

    `group`: a `minispeed.comm` group handle, a `ProcessGrid` (its `"tensor"` axis) or a
    `TensorGroup`. Every rank of the group calls it with the same unsplit model (same seed or
    same weights); each keeps its slices (`1/n` of every split weight). Refusals (see the module
    docstring) raise `ValueError` on every rank before anything changes. Cost per step: the sum
    of each split layer's collectives (`minispeed.tensor_parallel.costs`).
    """
    tg = TensorGroup.of(group)
    check_divides(tg.size, plan.divides)
    matched = _match(model, plan)
    _check_fresh(model, matched)
    _check_modules(model, matched, tg.size)
    _check_tied(model, matched)
    tied: dict[int, nn.Parameter] = {}
    for path, (_, style) in matched.items():
        _apply(model, path, style, tg, tied)
    return model
