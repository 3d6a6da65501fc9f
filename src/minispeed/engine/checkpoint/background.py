"""The engine's saver: one save at a time, written on the caller's thread or in the background.

```python
saver = checkpointer_of(engine)      # one per engine, built from the `checkpoint` section
saver.save(part, "ckpt", "global_step10", save_latest=True)
...                                  # with async_save: training goes on while the files land
saver.wait()                         # collective; the next save and every load call it first
```

Note [asynchronous save]
`checkpoint.async_save` splits a save in two. The collective half runs on the training thread:
probe the directory, unseal the tag, copy this rank's part into host memory
(`checkpoint.start_save`). Its cost is the copy: (4 + K)·Ψ/N bytes read once, no disk.
The local half runs on a daemon thread: write this rank's files (fsync, rename), leave a done
marker, and on the leaders seal the part when every marker is there and then the grid
(`grid.json`, `latest`) when every part is sealed (Note [done markers] in zero's
pending.py). The thread never calls a collective: the ranks agree through the shared
directory, so `latest` moves only once every rank's files are durable, and a process killed at
any moment leaves the previous `latest` naming a complete tag.

The next `save`, `load_checkpoint` and `wait` join the thread and agree over the world that
every rank's writer succeeded (two `all_gather_object`s), so a failed background write raises
on every rank at that point. At interpreter exit the thread is joined: this rank's files get up
to `EXIT_WAIT_S`, the other ranks' markers as long as a collective waits for a peer (the
process group's timeout, `init_distributed(timeout=...)`), and none at all once a collective of
this process has failed (a peer lost); a writer that gives up leaves `latest` where it was.
"""

from __future__ import annotations

import atexit
import enum
import os
import threading
import time
from typing import Any

import minispeed.comm as comm
from minispeed.core.logging import get_logger
from minispeed.engine.checkpoint.grid import (
    CheckpointConfig,
    GridPlace,
    GridSave,
    Part,
    save_now,
    start_save,
)
from minispeed.engine.checkpoint.load import load_part
from minispeed.zero.checkpoints import CheckpointError, together

__all__ = ["BackgroundSave", "Checkpointer", "SaveState", "checkpointer_of", "place_of"]

_log = get_logger("engine")

#: How long the exit waits for a background save to land before giving it up.
EXIT_WAIT_S = 600.0
_POLL_S = 0.01


class SaveState(enum.Enum):
    """Where a background save is; moved only by `BackgroundSave._move`, on its thread.

    | state | what exists |
    |---|---|
    | WRITING | the host snapshot ((4 + K)·Ψ/N bytes) and this rank's files being written |
    | SEALING | this rank's files durable, its done marker written; a leader waits to seal |
    | DONE | the part and grid sealed where this rank leads, `latest` moved; nothing held |
    | FAILED | an error kept for `Checkpointer.wait`, which raises it on every rank |
    """

    WRITING = "writing"
    SEALING = "sealing"
    DONE = "done"
    FAILED = "failed"


class BackgroundSave:
    """One `GridSave` written on a daemon thread (see Note [asynchronous save])."""

    def __init__(self, save: GridSave) -> None:
        self.save = save
        self.state = SaveState.WRITING
        self.files_done = threading.Event()  # left WRITING (files durable, or failed)
        self.stop = threading.Event()  # give up waiting for the other ranks
        self.files_error: BaseException | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"minispeed-checkpoint-{save.tag}", daemon=True
        )

    def start(self) -> None:
        """Start writing."""
        self.thread.start()

    def _move(self, allowed: tuple[SaveState, ...], to: SaveState) -> None:
        assert self.state in allowed, f"background save: {self.state} -> {to}"
        self.state = to

    def _run(self) -> None:
        save, pending = self.save, self.save.pending
        try:
            pending.write_done_marker(save.write_files())
            self._move((SaveState.WRITING,), SaveState.SEALING)
        except BaseException as e:  # reported on every rank by Checkpointer.wait
            self.files_error = e
            self._move((SaveState.WRITING,), SaveState.FAILED)
            return
        finally:
            self.files_done.set()
        try:
            if pending.storage.is_leader:
                pending.seal(pending.wait_for_markers(self.stop))
            if save.world.is_leader:
                self._wait_for_parts()
                save.seal_grid()
            self._move((SaveState.SEALING,), SaveState.DONE)
        except BaseException as e:
            self.error = e
            self._move((SaveState.SEALING,), SaveState.FAILED)
        self.save.pending = None  # the snapshot's host memory goes

    def _wait_for_parts(self) -> None:
        todo = set(self.save.parts)
        while todo:
            todo = {p for p in todo if not self.save.part_sealed(p)}
            if todo:
                if self.stop.is_set():
                    raise CheckpointError(
                        f"{self.save.what}: parts {sorted(p or '.' for p in todo)} were never "
                        "sealed; the tag stays incomplete and 'latest' was not moved"
                    )
                time.sleep(_POLL_S)


class Checkpointer:
    """Saves and loads one engine's checkpoints, at most one save in flight."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.job: BackgroundSave | None = None
        atexit.register(self._at_exit)

    def save(self, part: Part, save_dir: str | os.PathLike, tag: str, *, save_latest: bool) -> None:
        """Save `part` under `save_dir/tag` (collective over the world)."""
        self.wait()
        save = start_save(
            part,
            save_dir,
            tag,
            save_latest=save_latest,
            node_local=self.config.use_node_local_storage,
        )
        if not self.config.async_save:
            save_now(save)
            return
        self.job = BackgroundSave(save)
        self.job.start()

    def load(
        self, part: Part, load_dir: str | os.PathLike, tag: str | None, **kwargs: Any
    ) -> tuple[Any, Any]:
        """`load.load_part`, after the save in flight has landed."""
        self.wait()
        return load_part(part, load_dir, tag, universal=self.config.load_universal, **kwargs)

    def wait(self) -> None:
        """Wait for the save in flight (collective): raises on every rank if any rank's
        background writer failed."""
        job, self.job = self.job, None
        if job is None:
            return
        what = f"{job.save.what} (written in the background)"
        try:
            job.files_done.wait()
            together(None, what, lambda: _reraise(job.files_error))
        except BaseException:
            job.stop.set()  # the leaders would wait for markers that never come
            job.thread.join()
            raise
        job.thread.join()  # every marker is there: the seals finish
        assert job.state in (SaveState.DONE, SaveState.FAILED), job.state
        together(None, what, lambda: _reraise(job.error))

    def _at_exit(self) -> None:
        """Let the save in flight land before the process goes: this rank's own files (local
        work, up to `EXIT_WAIT_S`), then the other ranks' done markers for as long as a
        collective would wait for them (`comm.collective_timeout_s`), or not at all once a
        collective has failed: Note [a failed collective breaks the group] in minispeed.comm."""
        job = self.job
        if job is None:
            return
        job.files_done.wait(EXIT_WAIT_S)
        lost = comm.first_backend_error()
        if lost is None:
            job.thread.join(comm.collective_timeout_s())
        if job.thread.is_alive():
            job.stop.set()
            job.thread.join(5.0)
        failure = job.files_error or job.error
        if failure is not None or job.thread.is_alive():
            why = failure or "still waiting for other ranks"
            if lost is not None:
                why = f"a collective failed before the exit, so the other ranks' files may never come: {lost}"
            _log.warning(
                "%s did not complete at exit (%s); 'latest' was not moved", job.save.what, why
            )


def _reraise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def checkpointer_of(engine: Any) -> Checkpointer:
    """The engine's `Checkpointer`, built on first use from its config's `checkpoint` section."""
    saver = engine.__dict__.get("_checkpointer")
    if saver is None:
        saver = Checkpointer(engine.config.checkpoint)  # an EngineConfig's CheckpointConfig
        engine.__dict__["_checkpointer"] = saver
    return saver


def place_of(engine: Any) -> GridPlace:
    """The engine's place in the grid: its `grid` if it has one, else data parallelism only."""
    grid = getattr(engine, "grid", None)
    if grid is not None:
        return GridPlace.from_grid(grid)
    return GridPlace(data_rank=comm.get_rank(), data=comm.get_world_size())
