"""Which ranks see the same checkpoint directory: a probe file each, agreed before any write.

Note [who shares the checkpoint directory]
A checkpoint directory given as one path may still be several directories: each node's own
disk mounted at the same path, or (in tests, two agents on one machine acting as two nodes)
two paths. A save that assumes one shared directory then fails late and unevenly (the second
node's `os.replace` of a ``.tmp`` file finds no directory; the seal lists files that node
never sees). So before anything is written, every rank writes a probe file with a random name
into the tag directory, the ranks exchange the names (one ``all_gather_object``), each rank
lists which names it sees, and they exchange those lists (a second one). Ranks that see the
same set share a storage; the lowest rank of each set is its *leader*, the one that writes the
files a loader on that storage needs besides the shards (``common.pt``, ``metadata.json``,
``latest``).

- Without node-local storage every rank must see every probe, or the save is refused on every
  rank, naming which ranks see which, before a single checkpoint byte is written.
- With node-local storage (DeepSpeed's ``checkpoint.use_node_local_storage``) each storage
  gets the files its own ranks need to load again at the same placement.

Cost: one empty file per rank and two small all-gathers per save.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minispeed.zero.checkpoints.agree import together
from minispeed.zero.checkpoints.layout import CheckpointError

__all__ = ["StorageGroups", "probe_storage"]

_PROBE_PREFIX = ".probe-"


@dataclass(frozen=True)
class StorageGroups:
    """The ranks of a group that see the same directory, as sorted tuples of group ranks."""

    groups: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def mine(self) -> tuple[int, ...]:
        """The ranks that share this rank's directory (this rank included)."""
        return next(g for g in self.groups if self.rank in g)

    @property
    def is_leader(self) -> bool:
        """Whether this rank writes its storage's common files (the lowest rank seeing it)."""
        return self.mine[0] == self.rank

    @property
    def shared(self) -> bool:
        """Whether every rank sees one directory."""
        return len(self.groups) == 1


def probe_storage(
    group: Any, rank: int, directory: Path, what: str, *, node_local: bool
) -> StorageGroups:
    """Find which ranks of `group` share `directory` (collective: two all-gathers).

    Raises `CheckpointError` on every rank when the ranks do not all share it and `node_local`
    is False, or when the ranks' views are not a partition (a storage one rank sees only in part).
    See Note [who shares the checkpoint directory].
    """

    def write_probe() -> str:
        directory.mkdir(parents=True, exist_ok=True)
        name = f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
        (directory / name).touch()
        return name

    mine, names = together(group, what, write_probe, share=lambda name: name)

    def look() -> tuple[int, ...]:
        present = set(os.listdir(directory))
        return tuple(r for r, name in enumerate(names) if name in present)

    try:
        _, everyone = together(group, what, look, share=lambda seen: seen)
    finally:
        # Every rank has listed once the agreement returns (or failed): the probe is done.
        (directory / mine).unlink(missing_ok=True)
    groups = tuple(sorted(set(everyone)))
    consistent = all(r in view for r, view in enumerate(everyone)) and all(
        everyone[r] == view for view in groups for r in view
    )
    if not consistent:
        raise CheckpointError(
            f"{what}: the ranks' views of {directory} are inconsistent ({_views(everyone)}); "
            "give the ranks of each node one directory each (node-local) or one shared one"
        )
    if len(groups) > 1 and not node_local:
        raise CheckpointError(
            f"{what}: the checkpoint directory {directory} is not shared by all ranks "
            f"({_views(everyone)}), so no rank could load the whole checkpoint. Give every rank "
            "a directory on a shared file system, or set checkpoint.use_node_local_storage: "
            "true (zero.save_checkpoint(..., node_local=True)): each node then keeps the files "
            "its own ranks need to load again"
        )
    return StorageGroups(groups, rank)


def _views(everyone: list[tuple[int, ...]]) -> str:
    by_view: dict[tuple[int, ...], list[int]] = {}
    for r, view in enumerate(everyone):
        by_view.setdefault(view, []).append(r)
    return "; ".join(
        (f"ranks {rs} see" if len(rs) > 1 else f"rank {rs[0]} sees")
        + f" the probes of ranks {list(view)}"
        for view, rs in by_view.items()
    )
