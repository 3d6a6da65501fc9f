"""What `initialize` did to the model, recorded step by step as it ran: `Engine.describe()`.

```python
engine, *_ = minispeed.engine.initialize(model=model, config="ds.json")
print(engine.describe())        # this rank's view, in the order the steps ran
engine.composition.steps        # the same, as records
```

Each step of the composition (docs/architecture.md, "The composition order") runs inside
`Composition.step(name, model, keys)`, which snapshots the model before and after the step:
the hooks on every module and parameter (forward, backward, state-dict, gradient hooks, and
the attribute guard ZeRO-3 puts on a released parameter's class) and every module's type. The
difference is the step's: the hooks it installed and on which modules, the modules it split or
replaced. What the step decided (the grid and its groups, the parameters it partitioned and
their bytes on this rank, the optimizer and the keys that chose it, what is offloaded where)
it writes into its record while it runs, from the objects it just built. Nothing is re-derived
afterwards, so the description cannot drift from what ran; a test compares it with the model's
hooks and its parameters' storage after training.

Cost: two walks of the model's modules and parameters per step (a dict per module), at
`initialize` only; nothing during training.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "Composition",
    "ParamPlacement",
    "StepRecord",
    "hooks_of",
    "module_types",
    "placements",
]


def hooks_of(model: nn.Module) -> dict[str, Counter[str]]:
    """`{module path or parameter name: Counter(hook kind)}` of the hooks on `model` now: each
    module's hook dicts (`_forward_pre_hooks` counts as `forward_pre`, and so on for every
    `_*_hooks` dict torch keeps), each parameter's gradient hooks (`post_accumulate_grad`,
    `grad`) and `attribute_guard` when its class is not `nn.Parameter`'s own (ZeRO-3's
    released guard). The root module's path is `""`; a parameter is named as in
    `named_parameters()`."""
    found: dict[str, Counter[str]] = {}
    for path, module in model.named_modules():
        kinds = Counter(
            {
                name[1:].removesuffix("_hooks"): len(hooks)
                for name, hooks in vars(module).items()
                if name.endswith("_hooks") and isinstance(hooks, dict) and hooks
            }
        )
        if kinds:
            found[path] = kinds
    for name, p in model.named_parameters():
        kinds = Counter(
            {
                "post_accumulate_grad": len(getattr(p, "_post_accumulate_grad_hooks", None) or ()),
                "grad": len(getattr(p, "_backward_hooks", None) or ()),
                "attribute_guard": int(type(p) not in (nn.Parameter, torch.Tensor)),
            }
        )
        kinds = +kinds  # drop the zeros
        if kinds:
            found[name] = kinds
    return found


def module_types(model: nn.Module) -> dict[str, str]:
    """`{module path: class name}` of every module of `model`."""
    return {path: type(m).__name__ for path, m in model.named_modules()}


@dataclass(frozen=True)
class ParamPlacement:
    """One parameter after `zero.shard`, on this rank."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """The model's copy's dtype (the 16-bit one under mixed precision)."""
    model_bytes: int
    """Bytes of the model's copy held here now (0 for a released stage-3 parameter)."""
    fragment: tuple[int, int] | None
    """`(start, numel)` of the flat piece this rank's masters hold (None: not stepped here)."""
    master_bytes: int
    """Bytes of that piece's master (fp32 masters: 4 per element; 0 where the model's copy is
    the master itself or lives in an offload home)."""


@dataclass
class StepRecord:
    """One composition step, as it ran."""

    number: int
    name: str
    keys: tuple[str, ...] = ()
    """The ds_config keys (or `initialize` arguments) that selected what this step did."""
    lines: list[str] = field(default_factory=list)
    """What the step did, in words, written while it ran."""
    hooks: dict[str, Counter[str]] = field(default_factory=dict)
    """The hooks the step installed: `{module path or parameter name: Counter(kind)}`."""
    replaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Modules whose class the step changed: `{path: (before, after)}`; new modules have
    `before` `""`, removed ones `after` `""`."""
    params: list[ParamPlacement] = field(default_factory=list)
    """The parameters the step placed (zero.shard)."""

    def did(self, line: str) -> None:
        """Add a line of what the step did."""
        self.lines.append(line)


class Composition:
    """The steps `initialize` ran, in order (see the module docstring)."""

    def __init__(self) -> None:
        self.steps: list[StepRecord] = []

    @contextlib.contextmanager
    def step(
        self, name: str, model: nn.Module | None = None, keys: Iterable[str] = ()
    ) -> Iterator[StepRecord]:
        """Run one step inside: yields its record, then adds the hooks it installed on `model`
        and the modules it replaced (the differences of two snapshots)."""
        before = hooks_of(model) if model is not None else {}
        types = module_types(model) if model is not None else {}
        record = StepRecord(len(self.steps) + 1, name, tuple(keys))
        yield record
        if model is not None:
            after = hooks_of(model)
            for where, kinds in after.items():
                added = kinds - before.get(where, Counter())
                if added:
                    record.hooks[where] = added
            now = module_types(model)
            for path in dict.fromkeys([*types, *now]):
                if types.get(path) != now.get(path):
                    record.replaced[path] = (types.get(path, ""), now.get(path, ""))
        self.steps.append(record)

    def hooks(self) -> dict[str, Counter[str]]:
        """Every hook the steps installed, summed over the steps."""
        total: dict[str, Counter[str]] = {}
        for s in self.steps:
            for where, kinds in s.hooks.items():
                total.setdefault(where, Counter()).update(kinds)
        return total

    def placements(self) -> dict[str, ParamPlacement]:
        """`{parameter name: its placement}` from the step that placed the parameters."""
        return {p.name: p for s in self.steps for p in s.params}

    def text(self) -> str:
        """The steps as a reader's list (what `Engine.describe()` prints)."""
        out = ["What minispeed.engine.initialize did, in order (this rank):"]
        for s in self.steps:
            keys = f"  [{', '.join(s.keys)}]" if s.keys else ""
            out.append(f"{s.number}. {s.name}{keys}")
            out += [f"   - {line}" for line in s.lines]
            for path, (was, now) in s.replaced.items():
                what = f"{was} -> {now}" if was and now else (f"added {now}" if now else "removed")
                out.append(f"   - module {path or '<root>'}: {what}")
            if s.hooks:
                out.append(f"   - hooks installed on {len(s.hooks)} modules/parameters:")
                for where, kinds in _grouped(s.hooks):
                    out.append(f"       {where}: {kinds}")
            if s.params:
                out += _placement_lines(s.params)
        return "\n".join(out)


def _grouped(hooks: dict[str, Counter[str]]) -> list[tuple[str, str]]:
    """Lines `(where, kinds)`; consecutive places with the same kinds are folded into one line
    (`blocks.0.attn.qkv.weight ... (12 parameters)`)."""
    rows: list[tuple[str, str]] = []
    run: list[str] = []
    last = None
    for where, kinds in [*hooks.items(), ("", None)]:
        text = None if kinds is None else ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))
        if text != last and run:
            label = run[0] or "<root>"
            if len(run) > 1:
                label = f"{label} ... {run[-1]} ({len(run)})"
            rows.append((label, last or ""))
            run = []
        run.append(where)
        last = text
    return rows


def _placement_lines(params: list[ParamPlacement]) -> list[str]:
    model = sum(p.model_bytes for p in params)
    masters = sum(p.master_bytes for p in params)
    full = sum(_numel(p.shape) for p in params)
    here = sum(p.fragment[1] for p in params if p.fragment is not None)
    lines = [
        f"   - {len(params)} parameters ({full:,} elements) placed: this rank's masters hold "
        f"{here:,} elements ({masters:,} bytes), the model's copies {model:,} bytes here:"
    ]
    for p in params:
        frag = "not stepped here" if p.fragment is None else (
            f"elements [{p.fragment[0]:,}, {p.fragment[0] + p.fragment[1]:,}) "
            f"({p.master_bytes:,} B master)"
        )  # fmt: skip
        lines.append(f"       {p.name} {list(p.shape)} {p.dtype}: {p.model_bytes:,} B here, {frag}")
    return lines


def _bytes_here(p: torch.Tensor) -> int:
    """The bytes of `p`'s own elements held here: 0 when its storage is released (stage 3) or
    elsewhere (meta), else its elements (a view into a flat buffer counts its own part)."""
    if p.device.type == "meta" or p.untyped_storage().nbytes() == 0:
        return 0
    return p.numel() * p.element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def placements(model: nn.Module, optimizer: Any) -> list[ParamPlacement]:
    """Every parameter of `model` as `optimizer` (a `ZeroOptimizer`, just built) placed it."""
    out = []
    for name, p in model.named_parameters():
        frag = optimizer.fragment_of(p)
        piece = None if frag is None else (frag.start, frag.numel)
        master_bytes = 0
        if frag is not None and frag.numel:
            master = optimizer.param_groups[frag.group]["params"][frag.master_index]
            held = master.device.type != "meta"  # ZeRO-Infinity: in a swap file
            if held and master.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
                master_bytes = frag.numel * master.element_size()
        out.append(
            ParamPlacement(
                name,
                tuple(p.shape),
                str(p.dtype).removeprefix("torch."),
                _bytes_here(p),
                piece,
                master_bytes,
            )
        )
    return out
