"""What a ZeRO checkpoint looks like on disk, and how files get there without ever half-existing.

```text
CKPT_DIR/
  latest                                 "<tag>\\n", replaced atomically after the tag is complete
  <tag>/
    weights.rank00000-of-00002.pt        rank 0's fp32 master pieces: one flat tensor and its
                                         index [(name, start, numel)] (see pack_pieces)
    optim.rank00000-of-00002.pt          per optimizer state key (exp_avg, ...), the same kind
                                         of packed pieces; plus this rank's RNG states
    ...                                  (one pair per rank)
    common.pt                            rank 0: hyper-parameters, scalar optimizer state per
                                         parameter, loss scaler, step counters, model buffers
    pytorch_model.bin                    rank 0, with stage3_gather_16bit_weights_on_model_save
                                         only: the model's 16-bit state_dict (model16.py)
    metadata.json                        rank 0, written last: the "complete" marker and index,
                                         with every file's size (Note [damaged files])
    done.rank00000-of-00002.json         a background save only: rank 0's files are durable
                                         (Note [done markers] in pending.py)
```

With node-local storage (Note [who shares the checkpoint directory], storage.py) each storage
holds the shards of its own ranks plus its own ``common.pt``, ``metadata.json`` and ``latest``;
``metadata.json`` then names those ranks (``node_local_ranks``) and readers check their files
only.

The layout is *per parameter*: a fragment is named by the model's parameter name and the flat
range ``[start, start + numel)`` of that parameter it covers, never by a rank's flat-buffer offset.
So any world size or ZeRO stage can find the bytes of any parameter (``load.py``), and a reader
that wants weights only never opens an ``optim`` file (``consolidate.py``).

Note [atomic checkpoint]
Every file is written to a temporary name beside it, flushed, fsynced and renamed over its final
name, and the directory is fsynced, so a reader sees either no file or a whole one; a write that
fails removes its temporary file (`minispeed.core.files.atomic_write`, for every file of a
checkpoint: small text files such as ``metadata.json`` and ``latest`` are written with it
directly). The tag becomes
*complete* only when rank 0 writes ``metadata.json``, which it does after every rank's shards
are on disk (the gather of their shard records is the barrier). ``latest`` moves to the tag
after that. A crash anywhere before leaves ``latest`` on the previous complete tag, and the
interrupted tag has no ``metadata.json``, which loaders and the consolidation refuse by name.

Note [damaged files]
A file can still be damaged after the tag was sealed (a copy cut short, a disk that lost
blocks). ``metadata.json`` records the size in bytes of every file of the tag, so a reader checks
them with one ``stat`` each before opening anything (`check_sizes`), and a file that
``torch.load`` cannot read anyway (one overwritten with bytes of the same size) is reported by
`load_shard`, through which every reader opens the tag's files (loading, consolidating,
the engine's ``zero_to_fp32``). Either error names the file,
the tag, the damage, and the newest other tag of the directory that passes the same checks
(`complete_tags`), so the user knows what they can resume from.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from minispeed.core.files import atomic_write

__all__ = [
    "COMMON_FILE",
    "DONE_GLOB",
    "FORMAT_VERSION",
    "LATEST_FILE",
    "METADATA_FILE",
    "CheckpointError",
    "CheckpointMetadata",
    "ParamRecord",
    "ShardRecord",
    "atomic_save",
    "check_sizes",
    "complete_tags",
    "done_file",
    "iter_pieces",
    "load_shard",
    "optim_file",
    "pack_pieces",
    "read_metadata",
    "resolve_tag_dir",
    "weights_file",
]

#: Bumped whenever a reader of the previous layout would misread the new one.
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
LATEST_FILE = "latest"
COMMON_FILE = "common.pt"

#: Fault injection for tests (see Note [atomic checkpoint]): the rank named here exits in the
#: middle of writing its weights shard, as if the machine died.
CRASH_RANK_ENV = "MINISPEED_CHECKPOINT_CRASH_RANK"

_SHARD_RE = re.compile(r"^(weights|optim)\.rank(\d{5})-of-(\d{5})\.pt$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read as asked: incomplete, incompatible, or not this model's."""


def weights_file(rank: int, world_size: int) -> str:
    """File name of ``rank``'s fp32 weight fragments."""
    return f"weights.rank{rank:05d}-of-{world_size:05d}.pt"


#: The done markers of a background save (pending.py), for removal when a tag is unsealed.
DONE_GLOB = "done.rank*-of-*.json"


def done_file(rank: int, world_size: int) -> str:
    """File name of ``rank``'s done marker (Note [done markers] in pending.py)."""
    return f"done.rank{rank:05d}-of-{world_size:05d}.json"


def optim_file(rank: int, world_size: int) -> str:
    """File name of ``rank``'s optimizer-state fragments."""
    return f"optim.rank{rank:05d}-of-{world_size:05d}.pt"


@dataclass(frozen=True)
class ParamRecord:
    """One model parameter as the checkpoint knows it."""

    name: str  # first name in model.named_parameters()
    shape: tuple[int, ...]  # the full shape
    group: int  # optimizer param group at save time
    aliases: tuple[str, ...] = ()  # other names of the same (tied) parameter

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ShardRecord:
    """One rank's files and the flat ranges they hold: (name, start, numel) per piece."""

    rank: int
    weights_file: str
    optim_file: str
    pieces: tuple[tuple[str, int, int], ...]
    weights_bytes: int  # bytes of fp32 values in the weights file (the consolidation bound)
    weights_file_bytes: int | None = None  # file sizes (None: written before sizes were kept)
    optim_file_bytes: int | None = None


@dataclass(frozen=True)
class CheckpointMetadata:
    """The index written last (``metadata.json``): version, topology and where every piece is."""

    format_version: int
    tag: str
    world_size: int
    stage: int
    global_step: int
    params: tuple[ParamRecord, ...]
    shards: tuple[ShardRecord, ...]
    optimizer_class: str
    state_keys: tuple[str, ...]  # per-element optimizer state tensors (exp_avg, ...)
    state_dict_keys: tuple[str, ...]  # model.state_dict() order, for the consolidated file
    buffer_names: tuple[str, ...]  # model buffers saved in common.pt
    frozen_names: tuple[str, ...]  # parameters outside the optimizer, saved whole in common.pt
    common_file_bytes: int | None = None  # size of common.pt (None: not recorded)
    model_16bit_file: str | None = None  # the consolidated 16-bit state_dict, if one was written
    model_16bit_file_bytes: int | None = None
    node_local_ranks: tuple[int, ...] | None = None  # node-local: the ranks whose shards are here
    excluded_frozen_names: tuple[str, ...] = ()  # frozen parameters left out (exclude_frozen)

    def local_shards(self) -> tuple[ShardRecord, ...]:
        """The shard records whose files this directory holds (all, unless node-local)."""
        if self.node_local_ranks is None:
            return self.shards
        return tuple(s for s in self.shards if s.rank in self.node_local_ranks)

    def to_json(self) -> str:
        """Deterministic JSON text."""
        raw = asdict(self)
        if raw["node_local_ranks"] is None:  # a shared directory: the key readers before it knew
            del raw["node_local_ranks"]
        if not raw["excluded_frozen_names"]:  # likewise: written only when some were left out
            del raw["excluded_frozen_names"]
        return json.dumps(raw, indent=1)

    @staticmethod
    def from_json(text: str) -> CheckpointMetadata:
        """Parse `to_json`'s output (version checked by `read_metadata`)."""
        raw = json.loads(text)
        raw["params"] = tuple(
            ParamRecord(p["name"], tuple(p["shape"]), p["group"], tuple(p["aliases"]))
            for p in raw["params"]
        )
        raw["shards"] = tuple(
            ShardRecord(
                s["rank"],
                s["weights_file"],
                s["optim_file"],
                tuple((n, int(a), int(k)) for n, a, k in s["pieces"]),
                s["weights_bytes"],
                s.get("weights_file_bytes"),
                s.get("optim_file_bytes"),
            )
            for s in raw["shards"]
        )
        for key in ("state_keys", "state_dict_keys", "buffer_names", "frozen_names"):
            raw[key] = tuple(raw[key])
        raw["excluded_frozen_names"] = tuple(raw.get("excluded_frozen_names", ()))
        if raw.get("node_local_ranks") is not None:
            raw["node_local_ranks"] = tuple(raw["node_local_ranks"])
        return CheckpointMetadata(**raw)


# -- packed pieces: many small fragments as one tensor ------------------------------------------


def pack_pieces(pieces: list[tuple[str, int, torch.Tensor]]) -> dict[str, Any]:
    """{"index": [(name, start, numel)], "values": 1-D tensor}: the pieces' values back to back.

    One storage per file instead of one per fragment: a shard file is then its values plus a few
    hundred bytes, and reading it maps one record (Ψ/N·4 bytes for fp32 weights).
    """
    index = [(name, start, t.numel()) for name, start, t in pieces]
    if not pieces:
        return {"index": index, "values": torch.empty(0)}
    return {"index": index, "values": torch.cat([t.reshape(-1) for _, _, t in pieces]).to("cpu")}


def iter_pieces(packed: dict[str, Any]) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(name, start, values) of each piece of `pack_pieces`'s output (views, no copies)."""
    offset = 0
    for name, start, numel in packed["index"]:
        yield name, start, packed["values"][offset : offset + numel]
        offset += numel


# -- atomic writes (Note [atomic checkpoint]) --------------------------------------------------


class _DieMidWrite(io.RawIOBase):
    """A file wrapper that flushes what it has and kills the process halfway through a write."""

    def __init__(self, f: io.BufferedWriter) -> None:
        self.f = f
        self.calls = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.calls += 1
        if self.calls > 1:  # some bytes already on disk, the rest never will be
            self.f.flush()
            os.fsync(self.f.fileno())
            os._exit(17)
        return self.f.write(data)


class _KeepsWriteError(io.RawIOBase):
    """A file wrapper that keeps the `OSError` of a failed write: ``torch.save`` reports one as
    ``unexpected pos N vs M``, dropping the cause (a full disk, a file size limit)."""

    def __init__(self, f: io.BufferedWriter | _DieMidWrite) -> None:
        self.f = f
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise


def atomic_save(obj: Any, path: Path, *, crash_point: bool = False) -> int:
    """``torch.save`` to ``path`` atomically; returns the file size in bytes. A failed write
    raises the `OSError` the file system gave (``No space left on device``, ``File too
    large``), naming ``path``; nothing is left behind (`atomic_write`).

    ``crash_point``: this write is the one the test hook (``MINISPEED_CHECKPOINT_CRASH_RANK``)
    may interrupt.
    """

    def write(f: io.BufferedWriter) -> None:
        crash = crash_point and os.environ.get(CRASH_RANK_ENV) == os.environ.get("RANK", "0")
        kept = _KeepsWriteError(_DieMidWrite(f) if crash else f)
        try:
            torch.save(obj, kept)
        except RuntimeError as e:
            if kept.error is None:
                raise
            raise OSError(kept.error.errno, kept.error.strerror, str(path)) from e

    return atomic_write(path, write)


# -- reading ------------------------------------------------------------------------------------


def resolve_tag_dir(path: str | os.PathLike, tag: str | None = None) -> Path:
    """The tag directory: ``path/tag``, or ``path/<latest>``, or ``path`` itself if it is a tag."""
    root = Path(path)
    if tag is not None:
        return root / tag
    latest = root / LATEST_FILE
    if latest.is_file():
        return root / latest.read_text().strip()
    if (root / METADATA_FILE).is_file() or any(_SHARD_RE.match(p.name) for p in _listdir(root)):
        return root
    raise CheckpointError(
        f"{root} is neither a checkpoint directory with a '{LATEST_FILE}' file nor a tag "
        "directory; pass the directory given to save_checkpoint (and tag=... if it has no "
        f"'{LATEST_FILE}'), or the tag directory itself"
    )


def _listdir(path: Path) -> list[Path]:
    return sorted(path.iterdir()) if path.is_dir() else []


def _missing_shards(tag_dir: Path) -> tuple[list[str], list[str]]:
    """(present, missing) shard file names, inferring the expected set from the ``-of-N`` suffix."""
    present = [p.name for p in _listdir(tag_dir) if _SHARD_RE.match(p.name)]
    world_sizes = {int(_SHARD_RE.match(n).group(3)) for n in present}
    expected = {
        f(r, ws) for ws in world_sizes for r in range(ws) for f in (weights_file, optim_file)
    }
    return present, sorted(expected - set(present))


def read_metadata(tag_dir: Path, *, need_optimizer_state: bool = True) -> CheckpointMetadata:
    """Read and check ``metadata.json``: present (complete tag), of our format version, and with
    every shard file it lists (the weights only, when ``need_optimizer_state`` is False)."""
    meta_path = tag_dir / METADATA_FILE
    if not tag_dir.is_dir():
        raise CheckpointError(f"checkpoint tag directory {tag_dir} does not exist")
    if not meta_path.is_file():
        present, missing = _missing_shards(tag_dir)
        latest = tag_dir.parent / LATEST_FILE
        hint = (
            f"; '{LATEST_FILE}' points to {latest.read_text().strip()!r}, load that instead"
            if latest.is_file()
            else ""
        )
        raise CheckpointError(
            f"checkpoint {tag_dir} is incomplete: {METADATA_FILE} was never written, so the save "
            f"was interrupted. Missing shards: {missing or 'none (all shard files exist)'}; "
            f"present: {present}{hint}"
        )
    try:
        raw = json.loads(meta_path.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"a JSON {type(raw).__name__}, not an object")
    except ValueError as e:  # json.JSONDecodeError too
        raise CheckpointError(
            f"checkpoint file {meta_path} of tag {tag_dir.name!r} is damaged: it is not the JSON "
            f"index save_checkpoint writes ({e}). {_earlier_hint(tag_dir)}"
        ) from e
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {tag_dir} has format version {version}, but this minispeed.zero reads "
            f"version {FORMAT_VERSION}. Load it with the minispeed release that wrote it and "
            "consolidate it there (`python -m minispeed.zero consolidate CKPT_DIR OUT.pt`) into a "
            "plain fp32 state_dict, which loads anywhere with model.load_state_dict"
        )
    meta = CheckpointMetadata.from_json(meta_path.read_text())
    absent = [
        name
        for s in meta.local_shards()
        for name in (s.weights_file, s.optim_file)[: 2 if need_optimizer_state else 1]
        if not (tag_dir / name).is_file()
    ]
    if absent:
        raise CheckpointError(
            f"checkpoint {tag_dir} is complete but shard files {absent} are missing (deleted or not "
            "copied?); copy them back from where the checkpoint was written, or load another tag"
            f". {_earlier_hint(tag_dir)}"
        )
    check_sizes(tag_dir, meta, need_optimizer_state=need_optimizer_state)
    return meta


def _expected_sizes(meta: CheckpointMetadata, *, need_optimizer_state: bool) -> dict[str, int]:
    """{file name: recorded size in bytes} for the files a reader opens (recorded ones only)."""
    sizes = {COMMON_FILE: meta.common_file_bytes}
    for s in meta.local_shards():
        sizes[s.weights_file] = s.weights_file_bytes
        if need_optimizer_state:
            sizes[s.optim_file] = s.optim_file_bytes
    return {name: size for name, size in sizes.items() if size is not None}


def _size_damage(tag_dir: Path, meta: CheckpointMetadata, need_optimizer_state: bool) -> list:
    """[(file name, what is wrong)] for every file whose size differs from the recorded one."""
    damage = []
    for name, size in _expected_sizes(meta, need_optimizer_state=need_optimizer_state).items():
        path = tag_dir / name
        actual = path.stat().st_size if path.is_file() else None
        if actual is None:
            damage.append((name, "missing"))
        elif actual != size:
            what = "truncated" if actual < size else "longer than written"
            damage.append((name, f"{what}: {actual} bytes on disk, {size} bytes when saved"))
    return damage


def check_sizes(tag_dir: Path, meta: CheckpointMetadata, *, need_optimizer_state: bool) -> None:
    """Raise naming file, tag, damage and an earlier complete tag if a file's size is not the
    size it was saved with (Note [damaged files]). One ``stat`` per file."""
    damage = _size_damage(tag_dir, meta, need_optimizer_state)
    if damage:
        name, what = damage[0]
        more = f" (and {len(damage) - 1} more damaged files)" if len(damage) > 1 else ""
        raise CheckpointError(
            f"checkpoint file {tag_dir / name} of tag {meta.tag!r} is damaged: {what}{more}. "
            f"{_earlier_hint(tag_dir)}"
        )


def load_shard(path: Path, tag: str, **kwargs: Any) -> Any:
    """``torch.load(path, **kwargs)``, or an error naming the file, the tag and the damage: the
    one place a checkpoint file is opened (loading, consolidating, DeepSpeed's
    ``zero_to_fp32``). A file of the right size that is not what was saved (overwritten, bytes
    flipped) fails here: torch refuses it as a zip archive, a pickle or an mmap-able file."""
    try:
        return torch.load(path, **kwargs)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise CheckpointError(
            f"checkpoint file {path} of tag {tag!r} is damaged: torch.load cannot read it "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"{_earlier_hint(path.parent)}"
        ) from e


def complete_tags(root: Path) -> list[str]:
    """Tags under ``root`` that are sealed, of our format, with every file present at its saved
    size; newest (highest global step) first."""
    found = []
    for tag_dir in _listdir(root):
        meta_path = tag_dir / METADATA_FILE
        if not meta_path.is_file():
            continue
        try:
            meta = CheckpointMetadata.from_json(meta_path.read_text())
        except (ValueError, KeyError, TypeError):
            continue
        if meta.format_version != FORMAT_VERSION:
            continue
        shards = meta.local_shards()
        files = [COMMON_FILE, *(n for s in shards for n in (s.weights_file, s.optim_file))]
        if all((tag_dir / n).is_file() for n in files) and not _size_damage(tag_dir, meta, True):
            found.append((meta.global_step, tag_dir.name))
    return [tag for _, tag in sorted(found, reverse=True)]


def _earlier_hint(tag_dir: Path) -> str:
    """Which other tag of the directory is complete (what the user can load instead)."""
    others = [t for t in complete_tags(tag_dir.parent) if t != tag_dir.name]
    if not others:
        return f"No other complete tag in {tag_dir.parent}: re-save from a training run."
    return f"Tag {others[0]!r} in {tag_dir.parent} is complete: load it with tag={others[0]!r}."
