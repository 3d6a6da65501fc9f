"""A paged KV cache: fixed-size blocks from one pool, and a block table per sequence.

Each layer holds two tensors, `k` and `v`, of shape `(num_blocks, block_size, H, D)`, H the K/V
heads a layer caches (the model's `n_kv_head`: under grouped-query attention, LLaMA's
`num_key_value_heads`, fewer than its query heads; each is stored once). A sequence
owns a list of block ids (its block table); its position t lives in block `table[t // block_size]`
at slot `t % block_size`. Blocks are taken from a free list as a sequence grows and returned when
it finishes, so sequences of different lengths share one pool without reserving their maximum
length up front (the waste is under one block per sequence).

Memory (fp32): `2 · n_layer · num_blocks · block_size · H · D · 4` bytes, i.e.
`8 · n_layer · H · D` bytes per cached token (the model's width C for multi-head attention,
`C · KV / n_head` under grouped-query attention; see `kv_cache_bytes`).
"""

from __future__ import annotations

import torch

__all__ = ["CacheFullError", "PagedKVCache", "kv_cache_bytes"]


def kv_cache_bytes(
    n_layer: int, num_blocks: int, block_size: int, n_head: int, head_dim: int, elem_bytes: int = 4
) -> int:
    """Bytes of a pool: `2 (k and v) · n_layer · num_blocks · block_size · n_head · head_dim · elem_bytes`."""
    return 2 * n_layer * num_blocks * block_size * n_head * head_dim * elem_bytes


class CacheFullError(RuntimeError):
    """The pool has no free block for a sequence that needs one."""


class PagedKVCache:
    """The block pool and the per-sequence block tables of every layer's K and V."""

    def __init__(
        self,
        n_layer: int,
        n_head: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("n_layer", n_layer), ("n_head", n_head), ("head_dim", head_dim),
                            ("num_blocks", num_blocks), ("block_size", block_size)):  # fmt: skip
            if value < 1:
                raise ValueError(f"PagedKVCache.{name} must be >= 1, got {value}")
        shape = (num_blocks, block_size, n_head, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...
        self.tables: dict[int, list[int]] = {}  # sequence id -> block ids, in position order
        self.lengths: dict[int, int] = {}  # sequence id -> cached positions

    @property
    def free_blocks(self) -> int:
        """Blocks not owned by any sequence."""
        return len(self._free)

    def capacity_tokens(self) -> int:
        """Positions the whole pool holds: `num_blocks · block_size`."""
        return self.num_blocks * self.block_size

    def add_sequence(self, seq_id: int) -> None:
        """Start an empty sequence (no blocks yet)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} is already in the cache: free it first")
        self.tables[seq_id], self.lengths[seq_id] = [], 0

    def reserve(self, seq_id: int, new_tokens: int) -> None:
        """Make room for `new_tokens` more positions of `seq_id`, taking blocks from the pool.

        Raises `CacheFullError` (and takes nothing) when the pool is short.
        """
        table = self.tables[seq_id]
        need = -(-(self.lengths[seq_id] + new_tokens) // self.block_size) - len(table)
        if need > len(self._free):
            raise CacheFullError(
                f"sequence {seq_id} needs {need} more KV blocks of {self.block_size} tokens but "
                f"the pool has {len(self._free)} free of {self.num_blocks}: finish or free other "
                "sequences, or build the cache with more num_blocks"
            )
        table.extend(self._free.pop() for _ in range(max(need, 0)))

    def write(self, layer: int, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k`, `v` `(T, H, D)` at positions `length .. length + T` of `seq_id` (reserved)."""
        start = self.lengths[seq_id]
        pos = torch.arange(start, start + k.shape[0])
        blocks = torch.tensor(self.tables[seq_id], dtype=torch.long)[pos // self.block_size]
        self.k[layer][blocks, pos % self.block_size] = k
        self.v[layer][blocks, pos % self.block_size] = v

    def next_slots(self, seq_ids: list[int]) -> torch.Tensor:
        """Flat slot ids `(B,)`, `block · block_size + offset`, where each sequence's next
        position goes (reserved first). Computed once per decode step and reused by every
        layer's `write_next`."""
        bs = self.block_size
        return torch.tensor(
            [self.tables[s][self.lengths[s] // bs] * bs + self.lengths[s] % bs for s in seq_ids],
            device=self.k[0].device,
        )

    def write_next(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store one position per sequence: `k`, `v` `(B, H, D)` at flat `slots` from `next_slots`.

        One `index_copy_` per tensor into the pool viewed as `(num_blocks · block_size, H, D)`
        (cheaper per call than indexing with (block, offset) pairs)."""
        kl, vl = self.k[layer], self.v[layer]
        kl.view(-1, *kl.shape[2:]).index_copy_(0, slots, k)
        vl.view(-1, *vl.shape[2:]).index_copy_(0, slots, v)

    def advance(self, seq_id: int, tokens: int) -> None:
        """Count `tokens` positions as cached (after every layer wrote them)."""
        self.lengths[seq_id] += tokens

    def gather(self, layer: int, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense `(length, H, D)` K and V of the first `length` positions of `seq_id`."""
        pos = torch.arange(length)
        blocks = torch.tensor(self.tables[seq_id], dtype=torch.long)[pos // self.block_size]
        return self.k[layer][blocks, pos % self.block_size], self.v[layer][
            blocks, pos % self.block_size
        ]

    def block_tables(self, seq_ids: list[int]) -> torch.Tensor:
        """`(B, max_blocks)` int32 block ids, rows padded with 0 (never read past `lengths`), on
        the cache's device (filled on the host, copied once)."""
        width = max(1, max((len(self.tables[s]) for s in seq_ids), default=0))
        rows = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in seq_ids]
        return torch.tensor(rows, dtype=torch.int32).view(len(seq_ids), width).to(self.k[0].device)

    def free(self, seq_id: int) -> None:
        """Return `seq_id`'s blocks to the pool and forget it."""
        self._free.extend(reversed(self.tables.pop(seq_id)))
        del self.lengths[seq_id]
