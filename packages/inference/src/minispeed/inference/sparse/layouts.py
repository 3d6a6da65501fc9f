"""Sparsity layouts: which (query block, key block) pairs each head attends to.

A layout is a bool tensor `(H, NB, NB)` with `NB = T / block`: `layout[h, r, c]` True means the
`block` queries of block `r` see the `block` keys of block `c` in head `h`. The attention op
(`minispeed.inference.sparse.attention`) computes exactly the kept blocks, so time and the
score memory are `density × dense`, with `density = layout.sum() / (H · NB²)`.

The configs mirror DeepSpeed's `sparse_attention` section (same class names and keys, read by
`SparsityConfig.from_section(section, num_heads=H)`); the drawings use `#` for a kept block:

```text
fixed (local 4, global 1)  bigbird (window 3, 1 random, 1 global)  bslongformer (window 3, global [0])
####...#                   ########                                ########
####...#                   ###....#                                ###.....
####...#                   ####..#.                                ####....
####...#                   #.###..#                                #.###...
...#####                   #..###..                                #..###..
...#####                   #...###.                                #...###.
...#####                   #....###                                #....###
...#####                   #.....##                                #.....##
```

- local: each query block sees the blocks of its window (fixed windows, or a sliding window of
  `num_sliding_window_blocks` centred on the diagonal);
- global: chosen key blocks are seen by every query block (a column), and with horizontal
  global attention they also see everything (a row);
- random: `num_random_blocks` key blocks per query block, drawn with a seeded generator (the
  layout is a pure function of the config and `T`, so every rank and every step agrees);
- `attention="unidirectional"` keeps only blocks on or below the diagonal (the op's `causal`
  flag then masks the future inside the diagonal block).

Every layout must give each query block at least one key block: a row with nothing to attend
to would make softmax divide by zero, so `make_layout` and the op refuse it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from minispeed.core.config import ConfigError, join_path
from minispeed.core.sections import Section, key, read_section

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparsityConfig",
    "VariableSparsityConfig",
    "check_layout",
    "draw_layout",
    "layout_density",
]

_DIRECTIONS = ("unidirectional", "bidirectional")


def _blocks(value: Any) -> tuple[int, ...] | None:
    """A JSON list of block indices as a tuple (None stays None)."""
    return None if value is None else tuple(value)


def check_layout(layout: torch.Tensor, *, causal: bool = False) -> None:
    """Raise `ValueError` unless `layout` is a bool `(H, NB, NB)` whose every row keeps a block.

    With `causal`, a row must keep a block on or below the diagonal (the only keys a causal
    query may see); blocks above it are allowed but contribute nothing.
    """
    if layout.dtype != torch.bool or layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(
            f"a layout must be a bool tensor (heads, blocks, blocks), got {layout.dtype} "
            f"{tuple(layout.shape)}: build it with a SparsityConfig's make_layout(seq_len)"
        )
    kept = torch.tril(layout) if causal else layout
    empty = (~kept.any(dim=-1)).nonzero()
    if len(empty):
        h, r = (int(x) for x in empty[0])
        where = "on or below the diagonal " if causal else ""
        raise ValueError(
            f"layout row {r} of head {h} keeps no key block {where}({len(empty)} such rows): "
            "its queries would attend to nothing; add a local window (e.g. the diagonal block)"
        )


def layout_density(layout: torch.Tensor, *, causal: bool = False) -> float:
    """Fraction of the `T × T` scores computed: kept tiles / `H · NB²` (causal: tiles on or
    below the diagonal only; a dense causal layout then has density `(NB + 1) / (2 NB)`)."""
    kept = torch.tril(layout) if causal else layout
    return float(kept.sum()) / max(1, kept.numel())


def draw_layout(layout: torch.Tensor, head: int = 0) -> str:
    """One head's layout as text: a row per query block, `#` kept, `.` skipped."""
    return "\n".join("".join("#" if x else "." for x in row) for row in layout[head].tolist())


@dataclasses.dataclass(frozen=True)
class SparsityConfig(Section):
    """What every layout shares. Subclasses fill `_fill_head`; `make_layout` does the rest.

    `make_layout(seq_len)` costs `O(H · NB²)` bool ops, once per sequence length (the module
    caches it).
    """

    num_heads: int
    """Attention heads H (DeepSpeed passes it from the model, not the config section)."""
    block: int = key("block", 16)
    """Tokens per block (DeepSpeed key `block`): the layout's granularity."""
    different_layout_per_head: bool = key("different_layout_per_head", False)
    """Draw each head's random/global choices separately (else every head copies head 0's)."""

    mode: ClassVar[str] = ""
    ds_path: ClassVar[str] = "sparse_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_heads < 1 or self.block < 1:
            raise ValueError(
                f"num_heads and block must be >= 1, got {self.num_heads} and {self.block}"
            )
        direction = getattr(self, "attention", "bidirectional")
        if direction not in _DIRECTIONS:
            raise ValueError(f"attention must be one of {_DIRECTIONS}, got {direction!r}")

    @property
    def causal(self) -> bool:
        """True for `attention="unidirectional"`: the op then masks future keys token by token."""
        return getattr(self, "attention", "bidirectional") == "unidirectional"

    def num_blocks(self, seq_len: int) -> int:
        """`seq_len / block`; a length that is not a multiple of `block` raises with the fix."""
        if seq_len < 1 or seq_len % self.block:
            pad = -seq_len % self.block
            raise ValueError(
                f"sequence length {seq_len} is not a multiple of the sparsity block {self.block}: "
                f"pad the sequence by {pad} tokens (to {seq_len + pad}) and mask the padding"
            )
        return seq_len // self.block

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The bool layout `(H, NB, NB)` for `seq_len` tokens, checked (no empty row)."""
        nb = self.num_blocks(seq_len)
        layout = torch.zeros(self.num_heads, nb, nb, dtype=torch.bool)
        heads = self.num_heads if self.different_layout_per_head else 1
        for h in range(heads):
            self._fill_head(h, layout[h])
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        if self.causal:
            layout = torch.tril(layout)
        check_layout(layout, causal=self.causal)
        return layout

    def _fill_head(self, head: int, grid: torch.Tensor) -> None:  # grid: (NB, NB), in place
        raise NotImplementedError

    def _generator(self, head: int) -> torch.Generator:
        return torch.Generator().manual_seed(getattr(self, "seed", 0) * 1_000_003 + head)

    @classmethod
    def from_section(
        cls,
        section: Mapping[str, Any] | None = None,
        *,
        path: str | None = None,
        num_heads: int,
    ) -> SparsityConfig:
        """DeepSpeed's `sparse_attention` section (`mode` picks the class; left out: `fixed`),
        with the head count H, which DeepSpeed takes from the model.

        Keys not read by the chosen mode are refused with the list of those it reads.
        """
        path = cls.ds_path if path is None else path
        section = dict(section or {})
        mode = section.pop("mode", "fixed")
        classes = {c.mode: c for c in _CONFIGS}
        if mode not in classes:
            raise ConfigError(
                join_path(path, "mode"), f"{mode!r} is unknown; use one of {list(classes)}"
            )
        try:
            return read_section(classes[mode], section, path, num_heads=num_heads)
        except ConfigError as e:
            if "unknown key" not in e.reason:
                raise
            raise ConfigError(
                e.path, f"{e.reason} (for mode {mode!r}; or change the mode)"
            ) from None


def _fill_window(grid: torch.Tensor, start: int, end: int, causal: bool) -> None:
    """Queries of blocks `[start, end)` see keys of the same range (only up to the diagonal if causal)."""
    for row in range(start, end):
        grid[row, start : (row + 1 if causal else end)] = True


def _fill_sliding(grid: torch.Tensor, window: int, causal: bool) -> None:
    half = window // 2
    nb = grid.shape[0]
    for row in range(nb):
        grid[row, max(0, row - half) : (row + 1 if causal else min(nb, row + half + 1))] = True


def _fill_global_ranges(
    grid: torch.Tensor,
    starts: Sequence[int],
    ends: Sequence[int] | None,
    causal: bool,
    horizontal: bool,
) -> None:
    """Key blocks `[start, end)` are seen by every query (a column; from `start` on if causal);
    with `horizontal`, those blocks' queries also see every key (a row)."""
    nb = grid.shape[0]
    ends = [s + 1 for s in starts] if ends is None else ends
    for start, end in zip(starts, ends, strict=True):
        if start >= nb:
            continue
        end = min(end, nb)
        grid[start if causal else 0 :, start:end] = True
        if horizontal:
            grid[start:end, :] = True


@dataclasses.dataclass(frozen=True)
class DenseSparsityConfig(SparsityConfig):
    """Every block kept (density 1): the baseline, and a check that the op equals dense attention."""

    mode: ClassVar[str] = "dense"

    def _fill_head(self, head: int, grid: torch.Tensor) -> None:
        grid[:] = True


@dataclasses.dataclass(frozen=True)
class FixedSparsityConfig(SparsityConfig):
    """Fixed local windows plus global blocks at the end of each window ("Generating Long
    Sequences with Sparse Transformers"): density ≈ `L/NB + G/L` for window L, G global blocks.
    """

    num_local_blocks: int = key("num_local_blocks", 4)
    """Blocks per local window (windows tile the sequence, they do not slide)."""
    num_global_blocks: int = key("num_global_blocks", 1)
    """Blocks at the end of each window that every query sees; must divide `num_local_blocks`."""
    attention: str = key("attention", "bidirectional")
    """`"unidirectional"` (causal) or `"bidirectional"`."""
    horizontal_global_attention: bool = key("horizontal_global_attention", False)
    """Global blocks' queries also see everything (bidirectional only)."""
    num_different_global_patterns: int = key("num_different_global_patterns", 1)
    """Heads cycle over this many global positions within a window (needs per-head layouts)."""

    mode: ClassVar[str] = "fixed"

    def __post_init__(self) -> None:
        super().__post_init__()
        L, G, P = self.num_local_blocks, self.num_global_blocks, self.num_different_global_patterns
        if L < 1 or G < 1 or L % G:
            raise ValueError(f"num_global_blocks ({G}) must divide num_local_blocks ({L})")
        if self.horizontal_global_attention and self.causal:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")
        if P > 1 and not self.different_layout_per_head:
            raise ValueError("num_different_global_patterns > 1 needs different_layout_per_head")
        if not 1 <= P <= L // G:
            raise ValueError(f"num_different_global_patterns must be in [1, {L // G}], got {P}")

    def _fill_head(self, head: int, grid: torch.Tensor) -> None:
        nb, L, G = grid.shape[0], self.num_local_blocks, self.num_global_blocks
        for start in range(0, nb, L):
            _fill_window(grid, start, min(start + L, nb), self.causal)
        first = L - (1 + head % self.num_different_global_patterns) * G
        full = nb - nb % L
        starts = list(range(first, full, L))
        if full < nb:  # the last, partial window gets its own global blocks
            starts.append(min(full + first, nb - G))
        ends = [s + G for s in starts]
        _fill_global_ranges(grid, starts, ends, self.causal, self.horizontal_global_attention)


@dataclasses.dataclass(frozen=True)
class VariableSparsityConfig(SparsityConfig):
    """Local windows of varying sizes, chosen global blocks, and random blocks."""

    num_random_blocks: int = key("num_random_blocks", 0)
    """Random key blocks per query block (causal: drawn among the blocks up to the diagonal)."""
    local_window_blocks: tuple[int, ...] = key("local_window_blocks", (4,), read=_blocks)
    """Sizes of the first windows; the last size repeats to the end of the sequence."""
    global_block_indices: tuple[int, ...] = key("global_block_indices", (0,), read=_blocks)
    """Global key blocks (or the starts of global ranges, with `global_block_end_indices`)."""
    global_block_end_indices: tuple[int, ...] | None = key(
        "global_block_end_indices", None, read=_blocks
    )
    """Exclusive ends of the global ranges, one per start; `None`: single blocks."""
    attention: str = key("attention", "bidirectional")
    """`"unidirectional"` (causal) or `"bidirectional"`."""
    horizontal_global_attention: bool = key("horizontal_global_attention", False)
    """Global blocks' queries also see everything (bidirectional only)."""
    seed: int = key("seed", 0)
    """Seed of the random blocks (not a DeepSpeed key: DeepSpeed draws from Python's `random`)."""

    mode: ClassVar[str] = "variable"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_random_blocks < 0 or not self.local_window_blocks:
            raise ValueError("num_random_blocks must be >= 0 and local_window_blocks non-empty")
        if any(w < 1 for w in self.local_window_blocks):
            raise ValueError(f"local_window_blocks must be >= 1, got {self.local_window_blocks}")
        ends = self.global_block_end_indices
        if ends is not None and (
            len(ends) != len(self.global_block_indices)
            or any(e <= s for s, e in zip(self.global_block_indices, ends, strict=True))
        ):
            raise ValueError(
                "global_block_end_indices must give one end > start per global_block_indices entry"
            )
        if self.horizontal_global_attention and self.causal:
            raise ValueError("horizontal_global_attention needs attention='bidirectional'")

    def _fill_head(self, head: int, grid: torch.Tensor) -> None:
        nb = grid.shape[0]
        _fill_random(grid, self.num_random_blocks, self.causal, self._generator(head))
        start = 0
        for width in self.local_window_blocks:
            _fill_window(grid, start, min(start + width, nb), self.causal)
            start += width
        width = self.local_window_blocks[-1]
        for s in range(start, nb, width):
            _fill_window(grid, s, min(s + width, nb), self.causal)
        _fill_global_ranges(
            grid,
            self.global_block_indices,
            self.global_block_end_indices,
            self.causal,
            self.horizontal_global_attention,
        )


def _fill_random(grid: torch.Tensor, count: int, causal: bool, gen: torch.Generator) -> None:
    nb = grid.shape[0]
    if count > nb:
        raise ValueError(
            f"num_random_blocks ({count}) exceeds the {nb} blocks of this sequence: "
            "use a longer sequence or fewer random blocks"
        )
    for row in range(nb):
        choices = row + 1 if causal else nb
        cols = torch.randperm(choices, generator=gen)[: min(count, choices)]
        grid[row, cols] = True


@dataclasses.dataclass(frozen=True)
class BigBirdSparsityConfig(SparsityConfig):
    """BigBird: a sliding window, random blocks, and the first `num_global_blocks` as global
    rows and columns. Density ≈ `(W + R + 2G) / NB` for window W, R random, G global blocks."""

    num_random_blocks: int = key("num_random_blocks", 1)
    """Random key blocks per query block."""
    num_sliding_window_blocks: int = key("num_sliding_window_blocks", 3)
    """Width of the window centred on the diagonal, in blocks."""
    num_global_blocks: int = key("num_global_blocks", 1)
    """The first blocks: seen by all queries, and seeing all keys."""
    attention: str = key("attention", "bidirectional")
    """`"unidirectional"` (causal) or `"bidirectional"`."""
    seed: int = key("seed", 0)
    """Seed of the random blocks (not a DeepSpeed key)."""

    mode: ClassVar[str] = "bigbird"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_random_blocks < 0 or self.num_sliding_window_blocks < 1:
            raise ValueError("num_random_blocks must be >= 0 and num_sliding_window_blocks >= 1")
        if self.num_global_blocks < 0:
            raise ValueError("num_global_blocks must be >= 0")

    def _fill_head(self, head: int, grid: torch.Tensor) -> None:
        nb = grid.shape[0]
        if nb < max(self.num_sliding_window_blocks, self.num_global_blocks):
            raise ValueError(
                f"the sequence has {nb} blocks, fewer than the sliding window "
                f"({self.num_sliding_window_blocks}) or the global blocks ({self.num_global_blocks})"
            )
        _fill_random(grid, self.num_random_blocks, self.causal, self._generator(head))
        _fill_sliding(grid, self.num_sliding_window_blocks, self.causal)
        grid[: self.num_global_blocks, :] = True
        grid[:, : self.num_global_blocks] = True


@dataclasses.dataclass(frozen=True)
class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer: a sliding window plus global blocks that see and are seen by all."""

    num_sliding_window_blocks: int = key("num_sliding_window_blocks", 3)
    """Width of the window centred on the diagonal, in blocks."""
    global_block_indices: tuple[int, ...] = key("global_block_indices", (0,), read=_blocks)
    """Global blocks (or range starts, with `global_block_end_indices`)."""
    global_block_end_indices: tuple[int, ...] | None = key(
        "global_block_end_indices", None, read=_blocks
    )
    """Exclusive ends of the global ranges; `None`: single blocks."""
    attention: str = key("attention", "bidirectional")
    """`"unidirectional"` (causal) or `"bidirectional"`."""

    mode: ClassVar[str] = "bslongformer"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_sliding_window_blocks < 1:
            raise ValueError("num_sliding_window_blocks must be >= 1")
        ends = self.global_block_end_indices
        if ends is not None and len(ends) != len(self.global_block_indices):
            raise ValueError(
                "global_block_end_indices needs one end per global_block_indices entry"
            )

    def _fill_head(self, head: int, grid: torch.Tensor) -> None:
        _fill_sliding(grid, self.num_sliding_window_blocks, self.causal)
        # Longformer's global tokens attend both ways (the causal tril in make_layout trims them).
        _fill_global_ranges(
            grid, self.global_block_indices, self.global_block_end_indices, False, True
        )


@dataclasses.dataclass(frozen=True)
class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Only a sliding window (causal by default): density ≈ `W / NB`."""

    num_sliding_window_blocks: int = key("num_sliding_window_blocks", 3)
    """Width of the window, in blocks (causal: the diagonal and `W // 2` blocks before it)."""
    attention: str = key("attention", "unidirectional")
    """`"unidirectional"` (causal) or `"bidirectional"`."""

    mode: ClassVar[str] = "local"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_sliding_window_blocks < 1:
            raise ValueError("num_sliding_window_blocks must be >= 1")

    def _fill_head(self, head: int, grid: torch.Tensor) -> None:
        _fill_sliding(grid, self.num_sliding_window_blocks, self.causal)


_CONFIGS = (
    DenseSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    LocalSlidingWindowSparsityConfig,
)
