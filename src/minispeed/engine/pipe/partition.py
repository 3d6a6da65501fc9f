"""DeepSpeed's layer partition, cut for cut, handed to minispeed.pipeline as explicit boundaries.

minispeed.pipeline's own balanced cut minimises the heaviest part; DeepSpeed's
(`runtime.utils.partition_balanced`) minimises the spread between the heaviest and the lightest
part, ties going to the later cut, and its uniform cut gives the remainder to the later parts.
A script moved from DeepSpeed must get the same stages (checkpoints name layers by stage), so
the arithmetic below is DeepSpeed's, and the package receives `[0, b1, ..., n]`.

- `uniform`: ⌊n/k⌋ layers each, the first n mod k parts one more.
- `parameters`: a layer weighs its trainable parameter count.
- `type:<regex>`: a layer weighs 1 if its class name matches (case-insensitive), else 0.

Cost: O(n² · k) for the balanced cut (a few ms for n = 100 layers).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import minispeed.pipeline as pipeline

__all__ = ["boundaries", "partition_balanced", "partition_uniform"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's uniform cut: `num_parts + 1` boundaries."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):  # every boundary after i moves one layer later
        for j in range(i + 1, num_parts + 1):
            parts[j] += 1
    return parts


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """DeepSpeed's linear partition: minimise (heaviest − lightest part), later cut on ties."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    dp_max[0][0] = 0.0
    dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                seg = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], seg)
                min_sum = min(dp_min[k][j - 1], seg)
                cost = max_sum - min_sum
                # `>=` (not `>`): DeepSpeed keeps the last k among equal costs; an infeasible
                # (k, j − 1) costs inf and is replaced by the first finite cost that follows
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j] = cost, max_sum, min_sum
                    position[i][j] = k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


def _trainable_count(layer: Any, build: Callable[[Any], Any]) -> int:
    built = build(layer) if isinstance(layer, pipeline.LayerSpec) else layer
    if not isinstance(built, nn.Module):
        return 0
    return sum(p.numel() for p in built.parameters() if p.requires_grad)


def _layer_name(layer: Any) -> str | None:
    if isinstance(layer, pipeline.LayerSpec):
        return layer.name
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def boundaries(
    layers: Sequence[Any], num_stages: int, method: str, build_for_real: bool
) -> list[int]:
    """DeepSpeed's cut of `layers` into `num_stages` parts by `method` (case-insensitive).

    `build_for_real`: count parameters by building each layer on the CPU, as DeepSpeed does
    (it draws from the global RNG, which matters when layers are not seeded: the weights that
    follow are then DeepSpeed's); otherwise on the `meta` device (no allocation, no RNG).
    """
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(layers), num_stages)
    if method == "parameters":
        if build_for_real:
            counts = [_trainable_count(layer, lambda s: s.build()) for layer in layers]
        else:
            with torch.device("meta"):
                counts = [_trainable_count(layer, lambda s: s.build()) for layer in layers]
        return partition_balanced(counts, num_stages)
    if method.startswith("type:"):
        pattern = method.split(":")[1]
        try:
            rx = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise pipeline.PartitionError(
                f"partition_method {method!r}: bad regex ({exc})"
            ) from None
        weights = [1 if (n := _layer_name(x)) is not None and rx.search(n) else 0 for x in layers]
        if not any(weights):
            raise pipeline.PartitionError(
                f"partition_method {method!r} matches no layer class name; the layers are "
                f"{[_layer_name(x) for x in layers]}"
            )
        return partition_balanced(weights, num_stages)
    raise NotImplementedError(
        f"partition_method {method!r} is not implemented (DeepSpeed's 'profile' neither); use "
        "'parameters', 'uniform' or 'type:<regex>'"
    )
