"""One checkpoint directory for the whole process grid (pipe × data × tensor × expert).

```text
CKPT_DIR/
  latest                         "<tag>\\n", moved after grid.json (the grid's seal)
  zero_to_fp32.py zero_to_torch.py   DeepSpeed's converter commands (RECOVERY_SCRIPTS)
  <tag>/
    grid.json                    written last: the grid that saved it, its parts, its partition
    pipe00-of-02/                one *part* per (pipeline stage, expert rank): a zero checkpoint
      weights.rank00000-of-00002.pt   of that part's data-parallel group, files named by data rank
      optim.rank00000-of-00002.pt     (minispeed.zero's layout: layout.py there)
      common.pt  metadata.json
    pipe01-of-02/ ...
```

A part is named `pipe{stage}-of-{P}`, with `-tensor{t}-of-{T}` added under tensor parallelism
(its `client_state` then records each parameter's cut, for a load at another T:
`resplit.py`) and `-expert{e}-of-{E}` when there are expert ranks; within it, files are named by data rank. With one part (P = E = 1) the part *is* the
tag directory, so a data-parallel checkpoint stays a plain `minispeed.zero` checkpoint that
`python -m minispeed.zero consolidate` reads. Every part is a zero checkpoint: every engine,
a pipeline's included, steps a `ZeroOptimizer` (stage 0 when the config asks for no ZeRO).

**Loading** (`load.py`) finds the tag (`latest` or `tag=`), reads `grid.json` (a tag without one was
saved by a single-part engine) and refuses, naming both grids, a checkpoint whose pipeline
stages, expert ranks or layer partition differ from the engine's: those cannot be resharded.
Another data-parallel size loads (zero re-slices every parameter by name), and another
tensor-parallel size (`resplit.py`).

**The protocol** (Note [atomic checkpoint] in zero): every rank probes who shares the
directory (Note [who shares the checkpoint directory]), the grid leaders unseal the tag, each
part snapshots into host memory (`zero.checkpoints.snapshot`), writes its files, its
leader seals the part, and only when every part is sealed does the grid leader write
`grid.json`, then `latest`. With `checkpoint.async_save` the writing and sealing run on a
background thread (background.py). With `checkpoint.use_node_local_storage` every
storage gets its own ranks' files and its own `grid.json` and `latest`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torch import nn

import minispeed.comm as comm
import minispeed.zero as zero
from minispeed.core.config import field_error
from minispeed.core.files import atomic_write
from minispeed.core.sections import Section, Unsupported, ds_only, key
from minispeed.zero.checkpoints import (
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    StorageGroups,
    probe_storage,
    snapshot,
    together,
)

__all__ = [
    "ENGINE_STATE",
    "GRID_FILE",
    "LATEST_UNIVERSAL",
    "CheckpointConfig",
    "GridPlace",
    "GridSave",
    "Part",
    "PathLike",
    "find_tag",
    "has_latest",
    "latest_file",
    "part_dir",
    "read_grid",
    "save_now",
    "start_save",
]

PathLike = str | os.PathLike
GRID_FILE = "grid.json"
GRID_FORMAT_VERSION = 1
# The commands DeepSpeed writes beside its tag folders, written here by the grid leader with
# `latest`: `python zero_to_fp32.py . OUT/` turns the checkpoint into PyTorch weights; each is a
# few lines that run minispeed's module of the same name (importable from the folder too, as
# scripts that put the checkpoint folder on sys.path do).
RECOVERY_SCRIPTS = ("zero_to_fp32", "zero_to_torch")
_RECOVERY = """#!/usr/bin/env python
# Written by minispeed's save_checkpoint, as DeepSpeed writes its own script of this name:
#     python {name}.py CHECKPOINT_DIR OUTPUT_DIR{dtype} [-t TAG] [--max_shard_size 5GB]
# with the Python that has minispeed installed. The code: minispeed.engine.utils.{name}.
from minispeed.engine.utils.{name} import *  # noqa: F403
from minispeed.engine.utils.{name} import main

if __name__ == "__main__":
    raise SystemExit(main())
"""


def write_recovery_scripts(root: Path) -> None:
    """`RECOVERY_SCRIPTS` into `root`, each atomically and executable."""
    for name in RECOVERY_SCRIPTS:
        path = root / f"{name}.py"
        dtype = " --dtype bf16" if name == "zero_to_torch" else ""
        atomic_write(path, _RECOVERY.format(name=name, dtype=dtype))
        path.chmod(0o755)


# The key of a tensor-parallel part's client_state that records how each parameter is cut.
TENSOR_SPECS = "minispeed_tensor_specs"
# The key of a part's client_state holding the engine's own state (counters, scheduler); the
# caller's client_state is under "client" beside it.
ENGINE_STATE = "minispeed_engine"


def tensor_specs(module: nn.Module) -> dict[str, list[int]]:
    """`{parameter name: [dim, parts]}` of every tensor-parallel slice in `module`."""
    from minispeed.tensor_parallel.sharding import sharded_parameters

    return {n: [s.dim, s.parts] for n, s in sharded_parameters(module).items()}


TAG_VALIDATION_MODES = ("WARN", "FAIL", "IGNORE")


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """Checkpoints (DeepSpeed section `checkpoint`; minispeed.engine.checkpoint)."""

    ds_path: ClassVar[str] = "checkpoint"
    # DeepSpeed's checkpoint keys minispeed does not implement, accepted at their defaults.
    ds_unsupported: ClassVar[dict[str, Unsupported]] = {
        "parallel_write": ds_only(
            {"pipeline_stage": False}, "every rank writes its own shard files already"
        ),
        "checkpoint_serialization": ds_only(
            True, "one checkpoint format: torch.save's zip files, written atomically"
        ),
        "writer": ds_only(
            None, "DeepSpeed's fast checkpoint writers; use async_save to write in the background"
        ),
    }

    async_save: bool = key("async_save", False)
    """minispeed's key: write the files on a background thread while training goes on (a
    snapshot is copied to host memory first); the next save, `load_checkpoint` and the exit wait
    for it, and `latest` moves only once every rank's files are durable."""
    use_node_local_storage: bool = key("use_node_local_storage", False)
    """DeepSpeed's key: the ranks of each node may see their own directory at the checkpoint
    path; each node then keeps its ranks' files plus the common ones, and loads at the same
    placement. Without it, a directory not every rank sees is refused at save time."""
    load_universal: bool = key("load_universal", False)
    """DeepSpeed's key: `load_checkpoint(dir)` without a tag reads the tag `dir/latest_universal`
    names (DeepSpeed's `ds_to_universal` writes it beside `latest`), falling back to `latest`.
    A universal folder (one with `zero/`) loads with or without the key, at any data-parallel
    size and ZeRO stage (`universal.py`), and so does every other tag: the key only picks the
    file that names the tag."""
    tag_validation: str = key("tag_validation", "WARN")
    """DeepSpeed's key: whether `save_checkpoint` checks that every rank names the same tag
    (one gather of the tags): `"WARN"` (the default) logs a warning when they differ, `"FAIL"`
    raises on every rank, `"IGNORE"` does not check. Case-insensitive, as DeepSpeed's."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            not isinstance(self.tag_validation, str)
            or self.tag_validation.upper() not in TAG_VALIDATION_MODES
        ):
            raise field_error(
                self,
                "tag_validation",
                f"must be one of {', '.join(TAG_VALIDATION_MODES)} (any case), "
                f"got {self.tag_validation!r}",
            )
        if self.async_save and self.use_node_local_storage:
            raise field_error(
                self,
                "async_save",
                "async_save with use_node_local_storage is not supported: the background writers "
                "agree that every rank's files are durable through the shared directory, which "
                "node-local storage does not have; turn one of them off",
            )


@dataclass(frozen=True)
class GridPlace:
    """This rank's place in the grid, and the grid's shape."""

    stage: int = 0
    pipe: int = 1
    data_rank: int = 0
    data: int = 1
    expert_rank: int = 0
    expert: int = 1
    tensor_rank: int = 0
    tensor: int = 1

    @property
    def part(self) -> str | None:
        """This rank's part directory name (None: one part, the tag directory itself)."""
        if self.pipe == 1 and self.expert == 1 and self.tensor == 1:
            return None
        return part_name(self.stage, self.pipe, self.tensor_rank, self.tensor) + (
            f"-expert{self.expert_rank:02d}-of-{self.expert:02d}" if self.expert > 1 else ""
        )

    def shape(self) -> dict[str, int]:
        """`{"pipe": P, "data": D, "expert": E, "tensor": T}`."""
        return {"pipe": self.pipe, "data": self.data, "expert": self.expert, "tensor": self.tensor}

    @staticmethod
    def from_grid(grid: Any) -> GridPlace:
        """From a `minispeed.comm.ProcessGrid` with some of the axes pipe, data, expert, tensor."""
        axes = grid.topology.axes

        def coord(axis: str) -> tuple[int, int]:
            return (grid.rank_in(axis), grid.size(axis)) if axis in axes else (0, 1)

        (s, p), (d, n), (e, x), (t, m) = (coord(a) for a in ("pipe", "data", "expert", "tensor"))
        return GridPlace(s, p, d, n, e, x, t, m)


def part_name(stage: int, pipe: int, tensor_rank: int = 0, tensor: int = 1) -> str:
    """`pipe{s}-of-{P}`, with `-tensor{t}-of-{T}` when the tensor axis has T > 1 ranks."""
    name = f"pipe{stage:02d}-of-{pipe:02d}"
    return name + (f"-tensor{tensor_rank:02d}-of-{tensor:02d}" if tensor > 1 else "")


@dataclass
class Part:
    """What one rank saves: its module and its `ZeroOptimizer` (the part's files are zero's), in
    its part of the grid. `payload` is the engine's state (counters, scheduler, the client's
    state), carried in zero's `client_state`. `partition`: the pipeline's layer boundaries,
    compared on load. `exclude_frozen`: leave the frozen parameters out of the files
    (`save_checkpoint(exclude_frozen_parameters=True)`).
    """

    place: GridPlace
    module: nn.Module
    optimizer: zero.ZeroOptimizer
    payload: dict[str, Any]
    partition: list[int] | None = None
    exclude_frozen: bool = False


# The file DeepSpeed's `ds_to_universal` writes beside `latest`, naming the universal tag.
LATEST_UNIVERSAL = "latest_universal"


def latest_file(load_dir: PathLike, universal: bool = False) -> Path | None:
    """The file naming the tag to load, or None: `latest`; with `checkpoint.load_universal`,
    `latest_universal` first. Without the key, a directory holding only `latest_universal` (a
    universal checkpoint copied alone) loads from it too."""
    root = Path(load_dir)
    names = (LATEST_UNIVERSAL, LATEST_FILE) if universal else (LATEST_FILE, LATEST_UNIVERSAL)
    return next((root / n for n in names if (root / n).is_file()), None)


def has_latest(load_dir: PathLike, universal: bool = False) -> bool:
    """Whether `load_dir` has a file naming the tag to load (`latest_file`)."""
    return latest_file(load_dir, universal) is not None


def part_dir(tag_dir: Path, place: GridPlace) -> Path:
    """The directory of `place`'s part inside a tag directory."""
    return tag_dir if place.part is None else tag_dir / place.part


def grid_record(part: Part, tag: str) -> dict[str, Any]:
    """`grid.json`'s contents."""
    return {
        "format_version": GRID_FORMAT_VERSION,
        "tag": tag,
        "grid": part.place.shape(),
        "sharded": True,  # every part is a zero checkpoint (an older format had others)
        "partition": part.partition,
    }


def read_grid(tag_dir: Path) -> dict[str, Any] | None:
    """`grid.json` of a tag directory, or None for a single-part tag saved without one."""
    path = tag_dir / GRID_FILE
    if not path.is_file():
        parts = tag_dir.glob("pipe*-of-*") if tag_dir.is_dir() else ()
        if not any(p.is_dir() for p in parts):  # one part: zero names what is missing
            return None
        raise CheckpointError(
            f"checkpoint {tag_dir} is incomplete: {GRID_FILE} was never written, so the save of "
            f"the grid was interrupted; load the tag '{LATEST_FILE}' names, or another tag"
        )
    return json.loads(path.read_text())


def check_grid(saved: dict[str, Any] | None, part: Part, tag_dir: Path) -> None:
    """Raise naming both grids when the checkpoint cannot load into this grid (another
    tensor-parallel size loads when both sides are ZeRO-sharded: `resplit.py`)."""
    mine = part.place.shape()
    theirs = {"pipe": 1, "expert": 1, "tensor": 1, **(saved["grid"] if saved is not None else {})}
    if theirs["pipe"] != mine["pipe"] or theirs["expert"] != mine["expert"]:
        raise CheckpointError(
            f"checkpoint {tag_dir} was saved by a grid of {_grid_text(theirs)}, this engine runs "
            f"{_grid_text(mine)}: pipeline stages and expert ranks cannot be resharded (data "
            "parallelism and tensor parallelism can). Load it with the same pipeline stages and "
            "expert parallel size"
        )
    saved_partition = None if saved is None else saved.get("partition")
    if saved_partition is not None and saved_partition != part.partition:
        raise CheckpointError(
            f"checkpoint {tag_dir} was saved with the layers cut at {saved_partition}, this "
            f"pipeline cuts them at {part.partition}: build the PipelineModule with the same "
            "partition_method (or partition) that saved it"
        )
    if saved is not None and not saved.get("sharded", True):
        raise CheckpointError(
            f"checkpoint {tag_dir} holds a pipeline saved without ZeRO by an older minispeed "
            "(model_states.pt per stage), which this engine does not read: every engine now "
            "saves ZeRO's files; load it with the minispeed that saved it"
        )


def _grid_text(shape: dict[str, int]) -> str:
    data = f" x data {shape['data']}" if "data" in shape else ""
    tensor = f" x tensor {shape['tensor']}" if shape.get("tensor", 1) > 1 else ""
    return f"pipe {shape['pipe']}{data}{tensor} x expert {shape['expert']}"


# -- saving ---------------------------------------------------------------------------------------


@dataclass
class GridSave:
    """One save in progress: the snapshot of this rank's part and who writes what."""

    root: Path
    tag: str
    part: Part
    what: str
    world: StorageGroups  # who shares the tag directory, over the world
    pending: Any  # zero's PendingSave: this rank's snapshot, until its files are written
    save_latest: bool
    parts: tuple[str | None, ...]  # the parts of the ranks sharing this rank's directory

    @property
    def tag_dir(self) -> Path:
        """The tag directory."""
        return self.root / self.tag

    def write_files(self) -> tuple[int, int]:
        """This rank's files (local): zero's shards."""
        return self.pending.write_files()

    def part_sealed(self, place_part: str | None) -> bool:
        """Whether a part's seal file is in this rank's tag directory."""
        where = self.tag_dir if place_part is None else self.tag_dir / place_part
        return (where / METADATA_FILE).is_file()

    def seal_grid(self) -> None:
        """Grid leader: grid.json, then `latest` (every part is sealed)."""
        atomic_write(self.tag_dir / GRID_FILE, json.dumps(grid_record(self.part, self.tag)))
        write_recovery_scripts(self.root)
        if self.save_latest:
            atomic_write(self.root / LATEST_FILE, self.tag + "\n")


def start_save(
    part: Part, save_dir: str | os.PathLike, tag: str, *, save_latest: bool, node_local: bool
) -> GridSave:
    """The collective half of a grid save (every rank of the world): probe, unseal, snapshot."""
    root, world_rank = Path(save_dir), comm.get_rank()
    tag_dir = root / tag
    what = f"save_checkpoint of tag {tag!r}"
    world = probe_storage(None, world_rank, tag_dir, what, node_local=node_local)

    def unseal() -> None:
        if world.is_leader:  # a crash from here on leaves this tag refused by name
            (tag_dir / GRID_FILE).unlink(missing_ok=True)
            for path in (tag_dir / METADATA_FILE, *tag_dir.glob(f"*/{METADATA_FILE}")):
                path.unlink(missing_ok=True)  # each part's seal (Note [done markers])

    _, places = together(None, what, unseal, share=lambda _: part.place.part)
    parts = tuple(dict.fromkeys(places[r] for r in world.mine))
    sub_root, sub_tag = (root, tag) if part.place.part is None else (tag_dir, part.place.part)
    payload = part.payload
    if part.place.tensor > 1:  # how each parameter is cut, for a load at another size
        payload = {**payload, TENSOR_SPECS: tensor_specs(part.module)}
    pending = snapshot(
        part.optimizer, part.module, sub_root, sub_tag, client_state=payload,
        node_local=node_local, exclude_frozen=part.exclude_frozen,
    )  # fmt: skip
    return GridSave(root, tag, part, what, world, pending, save_latest, parts)


def save_now(save: GridSave) -> None:
    """The local half, on the caller's thread, each phase agreed over the world."""
    pending = save.pending
    mine = save.part.place.part
    _, sizes = together(None, save.what, save.write_files, share=lambda s: (mine, pending.rank, s))

    def seal_parts() -> None:
        if pending.storage.is_leader:
            by_rank = {r: s for p, r, s in sizes if p == mine}
            pending.seal([by_rank[r] for r in range(pending.world_size)])

    together(None, save.what, seal_parts)

    def seal_grid() -> None:
        if save.world.is_leader:
            save.seal_grid()

    together(None, save.what, seal_grid)


# -- loading --------------------------------------------------------------------------------------


def find_tag(load_dir: str | os.PathLike, tag: str | None, universal: bool = False) -> Path:
    """The tag directory: `load_dir/tag`, or the one `latest_file` names."""
    root = Path(load_dir)
    if tag is not None:
        return root / tag
    return root / (latest_file(root, universal) or root / LATEST_FILE).read_text().strip()
