"""Cut a list of layers into contiguous parts: `uniform`, `parameters`, `type:<regex>`, or given.

Pure arithmetic over per-layer weights (no torch.distributed), so every rank computes the same
cut without talking:

- `uniform`: every layer weighs 1; part i gets layers [⌊i·n/k⌋, ⌊(i+1)·n/k⌋).
- `parameters`: a layer weighs its parameter count (counted on the `meta` device, so nothing is
  allocated); the cut minimises the heaviest part.
- `type:<regex>`: a layer weighs 1 if its class name matches the regex (case-insensitive,
  `re.search`), else 0; the cut minimises the most matching layers in one part, and every part
  must hold at least one (e.g. `type:Block` spreads transformer blocks evenly and lets the
  embedding and head go where they fall).
- a list of k+1 boundaries `[0, b1, ..., n]`: used as given.

Cost of the balanced cut: O(k · n²) additions for n layers and k parts (a few ms for n = 200).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = ["PartitionError", "balanced_boundaries", "uniform_boundaries", "validate_boundaries"]


class PartitionError(ValueError):
    """The layers cannot be cut as asked: the message names the fix."""


def uniform_boundaries(num_layers: int, parts: int) -> list[int]:
    """k+1 boundaries giving each part ⌊n/k⌋ or ⌈n/k⌉ layers."""
    _check_counts(num_layers, parts)
    return [i * num_layers // parts for i in range(parts + 1)]


def balanced_boundaries(
    weights: Sequence[float], parts: int, require_weight: bool = False
) -> list[int]:
    """Contiguous cut of `weights` into `parts` non-empty parts minimising the heaviest part.

    Ties go to the cut whose boundaries come earliest. With `require_weight`, every part must
    carry a positive weight (used by `type:`).
    """
    n = len(weights)
    _check_counts(n, parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))

    def seg(j: int, i: int) -> float:
        w = prefix[i] - prefix[j]
        return math.inf if require_weight and w <= 0 else w

    # best[k][i]: lowest possible heaviest part when layers [0, i) form k parts
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], seg(j, i))
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    if math.isinf(best[parts][n]):
        raise PartitionError(
            f"cannot give each of {parts} parts a layer of positive weight (only "
            f"{sum(1 for w in weights if w > 0)} such layers): use fewer stages or another method"
        )
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def validate_boundaries(bounds: Sequence[int], num_layers: int, parts: int) -> list[int]:
    """Check user-given boundaries: k+1 increasing ints from 0 to n, no empty part."""
    b = [int(x) for x in bounds]
    if len(b) != parts + 1 or b[0] != 0 or b[-1] != num_layers:
        raise PartitionError(
            f"partition boundaries {b} must be {parts + 1} ints from 0 to {num_layers} "
            f"(one more than the {parts} parts)"
        )
    for i in range(parts):
        if b[i + 1] <= b[i]:
            raise PartitionError(
                f"partition boundaries {b} leave part {i} empty (layers [{b[i]}, {b[i + 1]})); "
                "every stage needs at least one layer: move a boundary"
            )
    return b


def type_weights(class_names: Sequence[str], pattern: str) -> list[float]:
    """1.0 for each class name matching `pattern` (case-insensitive), else 0.0."""
    try:
        rx = re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise PartitionError(f"partition method 'type:{pattern}': bad regex ({exc})") from None
    return [1.0 if rx.search(name) else 0.0 for name in class_names]


def _check_counts(num_layers: int, parts: int) -> None:
    if parts < 1:
        raise PartitionError(f"need at least one part, got {parts}")
    if num_layers < parts:
        raise PartitionError(
            f"{parts} stages (× virtual stages) but only {num_layers} layers: every stage needs "
            "at least one layer; use fewer stages or split the model into more layers"
        )
