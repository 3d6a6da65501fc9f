"""A checkpoint snapshotted into host memory, waiting to be written: purely local work.

`save.snapshot` (collective) copies what a tag will hold into a `PendingSave`; from then on
nothing needs another rank, so the files can be written on the caller's thread
(`save_checkpoint`: write, agree, seal, agree) or on a background thread while training goes
on. The background path cannot agree through a collective, so it agrees through the directory:

Note [done markers]
After a rank's shard files are durable (fsync, rename, directory fsync), it writes
``done.rankR-of-N.json`` (atomically too) holding their sizes. The leader of a storage (see
Note [who shares the checkpoint directory]) writes ``common.pt``, waits until it sees the
marker of every rank of its storage, and only then writes ``metadata.json`` (the seal, with
every size) and, if asked, moves ``latest``. A crash at any moment therefore leaves either a
sealed tag whose every file is whole, or an unsealed one that loaders refuse by name while
``latest`` still names the previous complete tag. Markers of an earlier save of the same tag
are removed when the tag is unsealed, before any rank writes (`save._plan`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from minispeed.core.files import atomic_write
from minispeed.zero.checkpoints.layout import (
    COMMON_FILE,
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    ShardRecord,
    atomic_save,
    done_file,
    optim_file,
    weights_file,
)
from minispeed.zero.checkpoints.model16 import MODEL_16BIT_FILE
from minispeed.zero.checkpoints.storage import StorageGroups

__all__ = ["PendingSave"]

#: How often a leader looks for the other ranks' done markers.
POLL_S = 0.01


@dataclass
class PendingSave:
    """One rank's share of a tag, in host memory (built by `save.snapshot`).

    Every tensor here is this object's own copy: training may go on while it is written.
    """

    what: str  # "save_checkpoint of tag '...'", for errors
    root: Path
    tag: str
    rank: int
    world_size: int
    storage: StorageGroups
    header: dict[str, Any]
    weights: dict[str, Any]  # pack_pieces output: this rank's fp32 masters
    states: dict[str, dict[str, Any]]  # per optimizer state key, the same
    rng: Any
    extra: Any  # the optimizer's rank_extra_state() (None for most): Note [a rank's extra state]
    owned: list[tuple[tuple[str, int, int], ...]]  # every rank's pieces, as written
    common: dict[str, Any] | None = None  # leaders: common.pt's contents
    meta: CheckpointMetadata | None = None  # leaders: the seal, without shard records
    model16: dict[str, Any] | None = None  # leaders: the 16-bit state_dict, if asked
    files_done: threading.Event = field(default_factory=threading.Event)

    @property
    def tag_dir(self) -> Path:
        """Where the tag's files go."""
        return self.root / self.tag

    def write_files(self) -> tuple[int, int]:
        """Write this rank's weights and optim files (atomically); returns their sizes."""
        wfile = weights_file(self.rank, self.world_size)
        ofile = optim_file(self.rank, self.world_size)
        # See Note [atomic checkpoint]; the weights file is where the crash test hook strikes.
        wbytes = atomic_save(
            {**self.header, **self.weights}, self.tag_dir / wfile, crash_point=True
        )
        obytes = atomic_save(
            {**self.header, "state": self.states, "rng": self.rng, "extra": self.extra},
            self.tag_dir / ofile,
        )
        self.files_done.set()
        return wbytes, obytes

    def write_done_marker(self, sizes: tuple[int, int]) -> None:
        """Tell the leader, through the directory, that this rank's files are durable."""
        text = json.dumps({"weights_file_bytes": sizes[0], "optim_file_bytes": sizes[1]})
        atomic_write(self.tag_dir / done_file(self.rank, self.world_size), text)

    def wait_for_markers(self, stop: threading.Event | None = None) -> list[tuple[int, int] | None]:
        """Leader: every rank's sizes once the markers of its storage's ranks are all there
        (None for ranks of other storages, whose files this storage never holds).

        Returns early with an error if `stop` is set (the process is exiting and gave up).
        """
        assert self.storage.is_leader
        sizes: list[tuple[int, int] | None] = [None] * self.world_size
        todo = set(self.storage.mine)
        while todo:
            for r in sorted(todo):
                marker = self.tag_dir / done_file(r, self.world_size)
                if marker.is_file():
                    raw = json.loads(marker.read_text())
                    sizes[r] = (raw["weights_file_bytes"], raw["optim_file_bytes"])
                    todo.discard(r)
            if todo:
                if stop is not None and stop.is_set():
                    raise CheckpointError(
                        f"{self.what}: ranks {sorted(todo)} never reported their files written; "
                        f"the tag stays unsealed and '{LATEST_FILE}' was not moved"
                    )
                time.sleep(POLL_S)
        return sizes

    def seal(self, sizes: list[tuple[int, int] | None]) -> None:
        """Leader: write `common.pt` (and the 16-bit model), then `metadata.json` (the seal)."""
        assert self.storage.is_leader and self.common is not None and self.meta is not None
        common_bytes = atomic_save(self.common, self.tag_dir / COMMON_FILE)
        model16_bytes = None
        if self.model16 is not None:
            model16_bytes = atomic_save(self.model16, self.tag_dir / MODEL_16BIT_FILE)
        shards = tuple(
            ShardRecord(
                r,
                weights_file(r, self.world_size),
                optim_file(r, self.world_size),
                self.owned[r],
                sum(n for _, _, n in self.owned[r]) * 4,
                None if sizes[r] is None else sizes[r][0],
                None if sizes[r] is None else sizes[r][1],
            )
            for r in range(self.world_size)
        )
        meta = replace(
            self.meta,
            shards=shards,
            common_file_bytes=common_bytes,
            model_16bit_file_bytes=model16_bytes,
            node_local_ranks=None if self.storage.shared else self.storage.mine,
        )
        atomic_write(self.tag_dir / METADATA_FILE, meta.to_json())

    def move_latest(self) -> None:
        """Leader: point `latest` at this tag (after `seal`)."""
        atomic_write(self.root / LATEST_FILE, self.tag + "\n")
