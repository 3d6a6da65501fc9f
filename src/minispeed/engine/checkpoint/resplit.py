"""Load a checkpoint saved at one tensor-parallel size into another (T → T', 1 and 2 included).

Under tensor parallelism each tensor rank is its own part of the tag
(`pipe{s}-of-{P}-tensor{t}-of-{T}`, a ZeRO checkpoint of that slice's data group) and records
in its `client_state` how each parameter is cut (`{name: [dim, parts]}`, the layers'
`ShardSpec`s). A rank loading at another size T':

1. reads every saved tensor part of its stage whole (weights and each per-element optimizer
   state, by parameter name: ZeRO's layout is per parameter, so this does not depend on the
   data-parallel size that saved them);
2. for each parameter cut along `dim` in `parts`: `join`s the T slices into the whole tensor
   and keeps its own slice of T' (`shard`); a replicated parameter (norms, row biases) is taken
   from tensor rank 0. The cut is the saved one when T > 1, else this model's (T = 1 saved
   whole tensors); both sides cut must agree where both are split;
3. writes the result as a one-rank ZeRO checkpoint in a private temporary directory and hands
   it to `zero.load_checkpoint`, which re-slices it over this data group and restores the
   hyper-parameters, scalar state (Adam's step), loss scale, counters and buffers of saved
   tensor rank 0 (they are the same on every tensor rank).

Steps 1-3 are local and agreed over the world (Note [a checkpoint fails on every rank]): a
checkpoint of another model (a parameter missing or of another shape) fails on every rank.
Cost per loading rank: reads the whole stage's checkpoint, (4 + K)·Ψ_stage bytes (K: optimizer
state bytes per parameter), holds it in host memory at once and writes (4 + K)·Ψ_stage/T'
bytes to the temporary directory. Refused: node-local checkpoints (each storage lacks the other
ranks' files) and parameters that are both frozen and split.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

import minispeed.zero as zero
from minispeed.engine.checkpoint.grid import TENSOR_SPECS, Part, part_dir, tensor_specs
from minispeed.tensor_parallel.sharding import ShardSpec, join, shard
from minispeed.zero.checkpoints import (
    COMMON_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    ParamRecord,
    ShardRecord,
    iter_pieces,
    load_shard,
    optim_file,
    pack_pieces,
    read_metadata,
    together,
    weights_file,
)

__all__ = ["load_resplit", "read_part", "write_one_rank"]

_TAG = "resplit"


def load_resplit(
    part: Part,
    tag_dir: Path,
    saved_tensor: int,
    *,
    load_optimizer_states: bool,
    what: str,
    strict: bool = True,
) -> dict[str, Any] | None:
    """This rank's part of `tag_dir`, saved at `saved_tensor` tensor ranks, re-cut for this
    rank's place (module docstring). Collective over the world; returns the saved payload."""
    work, _ = together(
        None, what, lambda: _convert(part, tag_dir, saved_tensor, load_optimizer_states)
    )
    try:
        payload = zero.load_checkpoint(
            part.optimizer,
            part.module,
            work,
            _TAG,
            load_optimizer_states=load_optimizer_states,
            strict=strict,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if payload is not None:
        payload = {k: v for k, v in payload.items() if k != TENSOR_SPECS}
    return payload


def read_part(src: Path, states: bool) -> tuple[CheckpointMetadata, dict, dict, Any]:
    """(metadata, {name: flat weights}, {state key: {name: flat}}, rank 0's RNG) of a part."""
    meta = read_metadata(src, need_optimizer_state=states)
    if meta.node_local_ranks is not None:
        raise CheckpointError(
            f"checkpoint part {src} was saved to node-local storage: another tensor-parallel "
            "size needs every rank's files in one directory; copy them together first"
        )
    sizes = {p.name: p.numel for p in meta.params}
    weights = {n: torch.empty(k) for n, k in sizes.items()}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    rng = None
    for record in meta.shards:
        saved = load_shard(src / record.weights_file, meta.tag, weights_only=True)
        for name, start, values in iter_pieces(saved):
            weights[name][start : start + values.numel()].copy_(values)
        if states and meta.state_keys:
            optim = load_shard(src / record.optim_file, meta.tag, weights_only=True)
            rng = optim["rng"] if record.rank == 0 else rng
            for key, packed in optim["state"].items():
                flat = moments.setdefault(key, {n: torch.zeros(k) for n, k in sizes.items()})
                for name, start, values in iter_pieces(packed):
                    flat[name][start : start + values.numel()].copy_(values)
    return meta, weights, moments, rng


def _convert(part: Part, tag_dir: Path, saved_tensor: int, states: bool) -> Path:
    place = part.place
    sources = [
        part_dir(tag_dir, dataclasses.replace(place, tensor_rank=r, tensor=saved_tensor))
        for r in range(saved_tensor)
    ]
    read = [read_part(src, states) for src in sources]
    meta = read[0][0]
    common = load_shard(sources[0] / COMMON_FILE, meta.tag, weights_only=False)
    saved_specs = (common.get("client_state") or {}).get(TENSOR_SPECS, {})
    my_specs = tensor_specs(part.module) if place.tensor > 1 else {}
    if saved_tensor > 1 and place.tensor > 1 and saved_specs != my_specs:
        name = next(n for n in {*saved_specs, *my_specs} if saved_specs.get(n) != my_specs.get(n))
        raise CheckpointError(
            f"checkpoint {tag_dir} cuts parameter {name!r} as {saved_specs.get(name)} "
            f"([dim, parts], None: whole), this model as {my_specs.get(name)}: load it with "
            "the tensor-parallel plan that saved it"
        )
    specs = {n: ShardSpec(*s) for n, s in (saved_specs or my_specs).items()}
    frozen_split = [n for n in meta.frozen_names if n in specs]
    if frozen_split:
        raise CheckpointError(
            f"parameter {frozen_split[0]!r} is frozen and split over tensor ranks: frozen "
            "parameters are saved by one rank only, so another tensor-parallel size cannot "
            "rebuild it; load at the same autotp_size"
        )
    shapes = [{p.name: tuple(p.shape) for p in m.params} for m, *_ in read]

    def recut(name: str, flats: list[torch.Tensor]) -> torch.Tensor:
        spec = specs.get(name)
        if spec is None:  # replicated over the tensor group: tensor rank 0's
            return flats[0].view(shapes[0][name])
        try:
            whole = join([f.view(s[name]) for f, s in zip(flats, shapes)], spec)
        except KeyError:
            raise CheckpointError(
                f"parameter {name!r} is in tensor part 0 of checkpoint {tag_dir} but not in all "
                "of its tensor parts; the checkpoint is damaged or of another model"
            ) from None
        return shard(whole, spec, place.tensor_rank, place.tensor)

    names = [p.name for p in meta.params]
    new_weights = {n: recut(n, [w[n] for _, w, _, _ in read]) for n in names}
    new_states = {
        key: {n: recut(n, [m[key][n] for _, _, m, _ in read]) for n in names} for key in read[0][2]
    }
    new_shapes = {n: tuple(t.shape) for n, t in new_weights.items()}
    flat = {n: t.reshape(-1) for n, t in new_weights.items()}
    flat_states = {k: {n: t.reshape(-1) for n, t in v.items()} for k, v in new_states.items()}
    return _write(meta, common, flat, flat_states, new_shapes, read[0][3])


def _write(meta, common, weights, states, shapes, rng) -> Path:
    """A one-rank ZeRO checkpoint of the re-cut tensors in a temporary directory."""
    work = Path(tempfile.mkdtemp(prefix="minispeed-tensor-resplit-"))
    new_meta = dataclasses.replace(
        meta,
        params=tuple(ParamRecord(p.name, shapes[p.name], p.group, p.aliases) for p in meta.params),
        common_file_bytes=None,
        model_16bit_file=None,
        model_16bit_file_bytes=None,
        node_local_ranks=None,
    )
    write_one_rank(work, _TAG, new_meta, common, weights, states, rng)
    return work


def write_one_rank(
    root: Path,
    tag: str,
    meta: CheckpointMetadata,
    common: dict[str, Any],
    weights: dict[str, torch.Tensor],
    states: dict[str, dict[str, torch.Tensor]],
    rng: Any,
) -> None:
    """`root/tag` as a one-rank ZeRO checkpoint holding whole parameters: `weights` and
    `states` (`{state key: {name: tensor}}`) by parameter name, `common.pt`, and `meta` with its
    tag, world size and shard record replaced. A private scratch directory, so written plainly
    (the caller removes it); `zero.load_checkpoint` re-slices it over any data-parallel size."""
    tag_dir = root / tag
    tag_dir.mkdir()
    names = [p.name for p in meta.params]
    header = {"format_version": meta.format_version, "rank": 0, "world_size": 1}
    flat = {n: weights[n].reshape(-1) for n in names}
    torch.save({**header, **pack_pieces([(n, 0, flat[n]) for n in names])},
               tag_dir / weights_file(0, 1))  # fmt: skip
    packed_states = {
        k: pack_pieces([(n, 0, v[n].reshape(-1)) for n in names]) for k, v in states.items()
    }
    torch.save({**header, "state": packed_states, "rng": rng}, tag_dir / optim_file(0, 1))
    torch.save(common, tag_dir / COMMON_FILE)
    new_meta = dataclasses.replace(
        meta,
        tag=tag,
        world_size=1,
        shards=(
            ShardRecord(
                0,
                weights_file(0, 1),
                optim_file(0, 1),
                tuple((n, 0, flat[n].numel()) for n in names),
                4 * sum(w.numel() for w in flat.values()),
            ),
        ),
    )
    (tag_dir / METADATA_FILE).write_text(new_meta.to_json())
