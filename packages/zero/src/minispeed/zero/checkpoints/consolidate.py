"""Turn a sharded ZeRO checkpoint into one fp32 ``state_dict`` file, streaming.

``torch.save(state_dict)`` needs every tensor in memory at once: Ψ·4 bytes, the very thing a
sharded checkpoint avoids. We write the output in three passes instead:

1. ``torch.save`` a *skeleton* under ``torch.serialization.skip_data()``: the same dict with fake
   tensors of the right shapes, so the archive gets every record, with the space for each
   storage reserved but not written (no tensor memory is allocated);
2. read where each storage's bytes live in the file (zip local headers, and the storage key
   each entry of ``data.pkl`` refers to), see Note [skeleton offsets];
3. open the weight shards one at a time (``mmap``) and ``pwrite`` each saved piece of fp32
   values straight to its place in the file.

The result is an ordinary ``torch.save`` file: ``torch.load(out)`` gives the model's
``state_dict`` (all parameter names, tied aliases included, and buffers), with fp32 parameters.
Only weight shards are read, never the optimizer moments.

Host memory: at most one shard's tensors (mapped, not copied: the kernel reads the pages we
touch and may drop them again) and no per-parameter buffer, so the peak is below the bound
``largest parameter + largest shard`` (4 bytes per element; ``common.pt``, rank 0's whole
buffers and frozen parameters, counts as a shard). The returned `ConsolidationReport`
counts the bytes of the tensors held at once (``peak_held_bytes``).

Note [skeleton offsets]
A ``torch.save`` archive is a zip of uncompressed records: ``data.pkl`` (the pickled dict,
in which each tensor names its storage by a key) and ``data/<key>`` (the raw bytes of each
storage). We unpickle ``data.pkl`` with a loader that records, for each state_dict entry, its
storage key instead of building a tensor, and read each record's data offset from its zip local
header (stdlib ``zipfile``). Tied parameters share one storage in the skeleton, so they share
one record in the output, as they would with ``torch.save(model.state_dict())``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from minispeed.core.files import atomic_replace
from minispeed.zero.checkpoints.layout import (
    COMMON_FILE,
    CheckpointError,
    CheckpointMetadata,
    iter_pieces,
    load_shard,
    read_metadata,
    resolve_tag_dir,
)

__all__ = ["ConsolidationReport", "consolidate"]


@dataclass(frozen=True)
class ConsolidationReport:
    """What a consolidation wrote and the host memory it held."""

    out_file: Path
    num_params: int  # elements of the parameters written
    total_bytes: int  # bytes of all tensors in the output
    largest_param_bytes: int
    largest_shard_bytes: int
    peak_held_bytes: int  # most bytes of tensors our code held at one time

    @property
    def bound_bytes(self) -> int:
        """The promise: never more than the largest parameter plus one shard."""
        return self.largest_param_bytes + self.largest_shard_bytes


class _KeyReader(pickle.Unpickler):
    """Unpickles a ``torch.save`` ``data.pkl`` into {name: (storage key, element offset)}."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, *rest: (storage, offset)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch":  # dtypes / storage classes: only their names are needed
            return name
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in a skeleton archive")

    def persistent_load(self, pid):
        # ('storage', storage_type, key, location, numel)
        return pid[2]


def _record_offsets(path: Path) -> tuple[dict[str, int], dict[str, tuple[str, int]]]:
    """(byte offset of each storage record by key, {entry name: (key, element offset)})."""
    offsets: dict[str, int] = {}
    entries: dict[str, tuple[str, int]] = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            parts = info.filename.split("/")
            if parts[-1] == "data.pkl":
                entries = _KeyReader(zf.open(info)).load()
            elif len(parts) >= 2 and parts[-2] == "data":
                if info.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(f"{path}: record {info.filename} is compressed")
                f.seek(info.header_offset)
                local = f.read(30)  # zip local file header; name and extra lengths at 26..30
                name_len, extra_len = struct.unpack("<HH", local[26:30])
                offsets[parts[-1]] = info.header_offset + 30 + name_len + extra_len
    return offsets, entries


def _write_skeleton(
    path: Path, meta: CheckpointMetadata, whole: dict[str, tuple[torch.Size, torch.dtype]]
) -> dict[str, int]:
    """Write the archive without data; return {state_dict key: element count}."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sizes: dict[str, int] = {}
    skeleton: dict[str, torch.Tensor] = {}
    with FakeTensorMode():  # no memory: fake tensors only carry shape and dtype
        by_name: dict[str, torch.Tensor] = {}
        for p in meta.params:
            t = torch.empty(p.shape, dtype=torch.float32)
            for name in (p.name, *p.aliases):
                by_name[name] = t  # aliases share the storage (Note [skeleton offsets])
        for name in (*meta.buffer_names, *meta.frozen_names):
            shape, dtype = whole[name]
            by_name[name] = torch.empty(shape, dtype=dtype)
        for key in meta.state_dict_keys:
            if key not in by_name:
                raise CheckpointError(
                    f"state_dict entry {key!r} is in neither the optimizer fragments, the buffers "
                    "nor the frozen parameters of this checkpoint; it cannot be consolidated"
                )
            skeleton[key] = by_name[key]
            sizes[key] = by_name[key].numel()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skeleton, path)
    return sizes


def _pwrite(fd: int, tensor: torch.Tensor, offset: int) -> None:
    data = memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _load_whole(tag_dir: Path) -> dict[str, torch.Tensor]:
    """Rank 0's whole buffers and frozen parameters from ``common.pt`` (mapped, not read)."""
    # weights_only=False: common.pt also carries the caller's client_state (trusted files only).
    common = load_shard(
        tag_dir / COMMON_FILE, tag_dir.name, map_location="cpu", mmap=True, weights_only=False
    )
    return {**common["buffers"], **common["frozen_params"]}


def _whole_specs(tag_dir: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    return {name: (t.shape, t.dtype) for name, t in _load_whole(tag_dir).items()}


def _write_whole(fd: int, tag_dir: Path, place, entries) -> int:
    """pwrite the buffers and frozen parameters; returns the bytes held (counted as a shard)."""
    whole = _load_whole(tag_dir)
    for name, value in whole.items():
        if name in entries:
            _pwrite(fd, value, place(name))
    return sum(v.numel() * v.element_size() for v in whole.values())


def _write_shard(fd: int, path: Path, place, written: dict[str, int]) -> int:
    """pwrite every piece of one weights shard to its place; returns the bytes it held."""
    saved = load_shard(path, path.parent.name, mmap=True, weights_only=True)
    for name, start, values in iter_pieces(saved):
        _pwrite(fd, values, place(name) + 4 * start)  # fp32: 4 bytes per element
        written[name] += values.numel()
    return saved["values"].numel() * saved["values"].element_size()


def consolidate(
    checkpoint_dir: str | os.PathLike,
    out_file: str | os.PathLike,
    tag: str | None = None,
    *,
    exclude_frozen: bool = False,
) -> ConsolidationReport:
    """Write the fp32 ``state_dict`` of a sharded checkpoint to ``out_file`` (streaming).

    ``checkpoint_dir``: the directory given to ``save_checkpoint`` (``tag`` defaults to its
    ``latest``) or a tag directory. The output loads with ``torch.load`` into
    ``model.load_state_dict``. Refuses an incomplete checkpoint, naming the missing shards.
    Command line: ``python -m minispeed.zero consolidate CKPT_DIR OUT.pt``.
    ``exclude_frozen``: leave the frozen parameters out (those a tag saved with
    ``exclude_frozen`` lacks are never in it).
    """
    tag_dir = resolve_tag_dir(checkpoint_dir, tag)
    meta = read_metadata(tag_dir, need_optimizer_state=False)  # weights only: moments never read
    if exclude_frozen:
        frozen = set(meta.frozen_names)
        keys = tuple(k for k in meta.state_dict_keys if k not in frozen)
        meta = dataclasses.replace(meta, state_dict_keys=keys, frozen_names=())
    out = Path(out_file)
    with atomic_replace(out) as tmp:  # a failure anywhere leaves no temporary file behind
        _write_skeleton(tmp, meta, _whole_specs(tag_dir))
        offsets, entries = _record_offsets(tmp)

        def place(name: str) -> int:
            key, element_offset = entries[name]
            return offsets[key] + 4 * element_offset

        written: dict[str, int] = dict.fromkeys((p.name for p in meta.params), 0)
        fd = os.open(tmp, os.O_WRONLY)
        try:
            # Each file is mapped inside one helper call, so its mapping dies when it returns.
            common_bytes = _write_whole(
                fd, tag_dir, lambda name: offsets[entries[name][0]], entries
            )
            peak = common_bytes
            for shard in meta.shards:
                peak = max(peak, _write_shard(fd, tag_dir / shard.weights_file, place, written))
        finally:
            os.close(fd)
        incomplete = [p.name for p in meta.params if written[p.name] != p.numel]
        if incomplete:
            raise CheckpointError(
                f"checkpoint {tag_dir}: the shards do not cover parameter {incomplete[0]!r} "
                f"({written[incomplete[0]]} of its elements written); it is damaged: re-save it"
            )
    return ConsolidationReport(
        out_file=out,
        num_params=sum(p.numel for p in meta.params),
        total_bytes=os.path.getsize(out),
        largest_param_bytes=max((4 * p.numel for p in meta.params), default=0),
        largest_shard_bytes=max([common_bytes, *(s.weights_bytes for s in meta.shards)]),
        peak_held_bytes=peak,
    )
