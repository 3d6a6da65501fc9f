"""A profile as data (`Profile`, a tree of `ModuleProfile`), as a rich tree table and as JSON.

Every count of a module **includes its children** (the profiler credits an operator to every
module running it). Parameters count each tensor once per module, so a weight tied between two
modules appears under both but once in their common parent and in the total.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from minispeed.core.files import atomic_write_json
from minispeed.profiler.formulas import Cost

__all__ = [
    "ModuleProfile",
    "Profile",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "human",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]


def human(x: float, unit: str = "") -> str:
    """`1234567` -> `1.23 M`: three significant digits with an SI prefix."""
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


_DS_UNITS = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """DeepSpeed's `number_to_string`: `124564` -> `"124.56 K"` (its `get_model_profile`
    strings; `human` is ours)."""
    if units is None:
        units = next((u for u, f in _DS_UNITS.items() if num >= f or (u == "" and num == 0)), "u")
    return f"{round(num / _DS_UNITS.get(units, 1.0), precision):g} {units}"


# DeepSpeed's other report strings, each `number_to_string` with its unit (its profiler's names).
def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    """`124564` -> `"124.56 KFLOPS"`."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    """`124564` -> `"124.56 KMACs"`."""
    return f"{number_to_string(macs, units, precision)}MACs"


def bytes_to_string(b: float, units: str | None = None, precision: int = 2) -> str:
    """`2048` -> `"2.05 KB"` (powers of 1000, as DeepSpeed's)."""
    return f"{number_to_string(b, units, precision)}B"


def duration_to_string(seconds: float, units: str | None = None, precision: int = 2) -> str:
    """`0.0123` -> `"12.3 ms"`."""
    return f"{number_to_string(seconds, units, precision)}s"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    """`1.5e9` -> `"1.5 B"`: billions are `B`, not `G`."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


@dataclass
class ModuleProfile:
    """One module's share of the step (children included)."""

    name: str
    """Qualified name under the profiled model (`model` for the root)."""
    type: str
    params: int
    """Parameters of the module and its children, each tensor once."""
    calls: int
    """Forward calls during the step (recomputations not counted)."""
    forward: Cost
    backward: Cost
    """Backward, recomputation included."""
    recompute: Cost
    """Forward re-run inside backward by activation checkpointing (part of `backward`)."""
    forward_s: float
    """Forward latency summed over calls, seconds (profiling overhead included when counting)."""
    backward_s: float
    children: list[ModuleProfile] = field(default_factory=list)

    @property
    def flops(self) -> int:
        """Forward + backward FLOPs."""
        return self.forward.flops + self.backward.flops

    def find(self, name: str) -> ModuleProfile:
        """The descendant called `name` (qualified, as in `named_modules`; `model` is the root)."""
        if self.name == name:
            return self
        for child in self.children:
            if name == child.name or name.startswith(child.name + "."):
                return child.find(name)
        raise KeyError(f"no module named {name!r} in the profile")

    def to_json(self) -> dict[str, Any]:
        """The subtree as plain data (FLOPs, MACs per phase; latencies in seconds)."""
        return {
            "name": self.name,
            "type": self.type,
            "params": self.params,
            "calls": self.calls,
            "forward": {"flops": self.forward.flops, "macs": self.forward.macs},
            "backward": {"flops": self.backward.flops, "macs": self.backward.macs},
            "recompute": {"flops": self.recompute.flops, "macs": self.recompute.macs},
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "children": [c.to_json() for c in self.children],
        }


@dataclass
class Profile:
    """The step: the module tree, totals per phase, operators, and achieved throughput."""

    root: ModuleProfile
    forward: Cost
    backward: Cost
    recompute: Cost
    outside_forward: Cost
    """Work run outside every module of the model (a loss computed by the caller)."""
    outside_backward: Cost
    wall_s: float
    """Time inside the profiler's `with` block, seconds."""
    op_totals: dict[str, Cost]
    op_calls: dict[str, int]
    unknown_ops: dict[str, int]
    """Operators the table does not price, with their call counts: their FLOPs are missing."""
    peak_flops_per_s: float | None = None
    matmul_shapes: dict[tuple[int, int, int, int], int] = field(default_factory=dict)
    """Calls of each matrix-product shape `(batch, m, k, n)` (mm, addmm, bmm, baddbmm)."""

    @property
    def flops(self) -> int:
        """All FLOPs of the step (forward + backward, recomputation included)."""
        return self.forward.flops + self.backward.flops

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s: `flops / wall_s`."""
        return self.flops / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def peak_fraction(self) -> float | None:
        """`flops_per_s / peak_flops_per_s`, when a peak was given."""
        return self.flops_per_s / self.peak_flops_per_s if self.peak_flops_per_s else None

    def module(self, name: str) -> ModuleProfile:
        """The `ModuleProfile` of module `name` (`""` or `"model"` for the root)."""
        return self.root.find(name or "model")

    def to_json(self) -> dict[str, Any]:
        """Everything as plain data, ready for `json.dump`."""
        return {
            "forward": {"flops": self.forward.flops, "macs": self.forward.macs},
            "backward": {"flops": self.backward.flops, "macs": self.backward.macs},
            "recompute": {"flops": self.recompute.flops, "macs": self.recompute.macs},
            "outside_modules": {
                "forward_flops": self.outside_forward.flops,
                "backward_flops": self.outside_backward.flops,
            },
            "wall_s": self.wall_s,
            "flops_per_s": self.flops_per_s,
            "peak_flops_per_s": self.peak_flops_per_s,
            "peak_fraction": self.peak_fraction,
            "ops": {
                name: {"calls": self.op_calls.get(name, 0), "flops": c.flops, "macs": c.macs}
                for name, c in sorted(self.op_totals.items(), key=lambda kv: -kv[1].flops)
            },
            "unknown_ops": self.unknown_ops,
            "modules": self.root.to_json(),
        }

    def write_json(self, path: str) -> None:
        """Write `to_json()` to `path`."""
        atomic_write_json(path, self.to_json(), indent=1)

    def table(self, depth: int = -1, top_k: int = -1, detailed: bool = True) -> Table:
        """A rich table of the module tree, `depth` levels below the root (-1: all), keeping the
        `top_k` children of each module with the most FLOPs (-1: all), then the work run
        outside every module when there is any (the root row plus it is the total).
        `detailed=False` shows the root and the totals only."""
        total = self.flops or 1
        t = Table(title=self._title(), show_lines=False)
        for col in ("module", "type", "params", "fwd FLOPs", "bwd FLOPs", "MACs", "% FLOPs",
                    "fwd ms", "bwd ms", "calls"):  # fmt: skip
            t.add_column(col, justify="left" if col in ("module", "type") else "right")

        def add(m: ModuleProfile, level: int) -> None:
            t.add_row(
                "  " * level + (m.name.rsplit(".", 1)[-1] if level else m.name),
                m.type,
                human(m.params),
                human(m.forward.flops),
                human(m.backward.flops),
                human(m.forward.macs + m.backward.macs),
                f"{100 * m.flops / total:.1f}",
                f"{1e3 * m.forward_s:.2f}",
                f"{1e3 * m.backward_s:.2f}",
                str(m.calls),
            )
            if not detailed or (depth >= 0 and level >= depth):
                return
            kids = sorted(m.children, key=lambda c: -c.flops)
            for child in kids if top_k < 0 else kids[:top_k]:
                add(child, level + 1)

        add(self.root, 0)
        outside = self.outside_forward + self.outside_backward
        if outside.flops:  # so the rows add up to the title's total (a loss the caller computed)
            t.add_row(
                "(outside modules)", "", "", human(self.outside_forward.flops),
                human(self.outside_backward.flops), human(outside.macs),
                f"{100 * outside.flops / total:.1f}", "", "", "",
            )  # fmt: skip
        return t

    def _title(self) -> str:
        parts = [
            f"forward {human(self.forward.flops, 'FLOP')}",
            f"backward {human(self.backward.flops, 'FLOP')}",
        ]
        if self.recompute.flops:
            parts.append(f"(recompute {human(self.recompute.flops, 'FLOP')})")
        parts.append(f"{human(self.flops_per_s, 'FLOP/s')} achieved")
        if self.peak_fraction is not None:
            parts.append(f"{100 * self.peak_fraction:.1f}% of peak")
        if self.unknown_ops:
            parts.append(f"unknown ops: {', '.join(sorted(self.unknown_ops))}")
        return "; ".join(parts)

    def render(self, depth: int = -1, top_k: int = -1, detailed: bool = True) -> str:
        """The table as text (what `print(profile)` would show in a terminal 160 wide)."""
        out = io.StringIO()
        Console(width=160, file=out, color_system=None).print(self.table(depth, top_k, detailed))
        return out.getvalue()
