"""Save a model with experts once per expert; load it into any expert-parallel degree.

Layout of a checkpoint directory:

    meta.json                      version, num_experts per layer, the saving E_p and world size
    dense.pt                       every non-expert tensor (written by global rank 0)
    <layer>.expert<g>.pt           expert g of the MoE layer at module path <layer>,
                                   written by the rank holding it in expert-data group 0

Each expert is written exactly once whatever W and E_p are (the W/E_p replicas in its
expert-data group are equal after `reduce_gradients`), so the directory holds Ψ_dense +
L·E·Ψ_expert parameters. Loading reads `dense.pt` and only the experts this rank holds under
the NEW degree, so E_p may change between save and load. Every file is written to a temporary
name, fsynced and renamed (a crash leaves the old file or none, never half of one); meta.json is
written last, so a directory without it is an unfinished save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.core.files import atomic_write
from minispeed.moe.layer import MoE

__all__ = ["CHECKPOINT_VERSION", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_VERSION = 1


def _layer_paths(model: nn.Module) -> dict[str, MoE]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


def _expert_prefixes(model: nn.Module) -> list[str]:
    return [
        f"{name}.experts.local_experts." if name else "experts.local_experts."
        for name in _layer_paths(model)
    ]


def _dense_state(model: nn.Module) -> dict[str, torch.Tensor]:
    prefixes = tuple(_expert_prefixes(model))
    return {
        k: v.detach().cpu() for k, v in model.state_dict().items() if not k.startswith(prefixes)
    }


def _file(directory: Path, layer: str, global_id: int) -> Path:
    return directory / f"{layer or 'root'}.expert{global_id}.pt"


def save_checkpoint(model: nn.Module, directory: str | os.PathLike) -> list[Path]:
    """Write `model` to `directory` (collective when distributed). Returns the files THIS rank
    wrote: `dense.pt` on rank 0, its experts' files on expert-data coordinate 0."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    layers = _layer_paths(model)
    if not layers:
        raise ValueError("save_checkpoint: the model has no MoE layer")
    groups = next(iter(layers.values())).groups
    written: list[Path] = []
    if groups.rank == 0:
        path = directory / "dense.pt"
        atomic_write(path, lambda f: torch.save(_dense_state(model), f))
        written.append(path)
    first_replica = groups.rank // groups.expert_parallel_degree == 0
    for name, layer in layers.items():
        if not first_replica:
            continue
        for gid, expert in zip(layer.experts.global_ids, layer.experts.local_experts):
            state = {k: v.detach().cpu() for k, v in expert.state_dict().items()}
            path = _file(directory, name, gid)
            atomic_write(path, lambda f, s=state: torch.save(s, f))
            written.append(path)
    if comm.is_initialized() and groups.world_size > 1:
        comm.barrier()  # every file is in place before meta.json says the save is complete
    if groups.rank == 0:
        meta = {
            "version": CHECKPOINT_VERSION,
            "layers": {name: layer.config.num_experts for name, layer in layers.items()},
            "saved_expert_parallel_degree": groups.expert_parallel_degree,
            "saved_world_size": groups.world_size,
        }
        atomic_write(
            directory / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode())
        )
        written.append(directory / "meta.json")
    return written


def load_checkpoint(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load `directory` into `model`, whatever expert-parallel degree each was built with.

    Checks the version and that the layers and their expert counts match.
    """
    directory = Path(directory)
    meta_path = directory / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"load_checkpoint: {meta_path} is missing: not an MoE checkpoint, or its save did not "
            "finish"
        )
    meta = json.loads(meta_path.read_text())
    if meta.get("version") != CHECKPOINT_VERSION:
        raise ValueError(
            f"load_checkpoint: version {meta.get('version')} in {meta_path}, this code reads "
            f"version {CHECKPOINT_VERSION}"
        )
    layers = _layer_paths(model)
    want = {name: layer.config.num_experts for name, layer in layers.items()}
    if meta["layers"] != want:
        raise ValueError(
            f"load_checkpoint: the checkpoint has MoE layers {meta['layers']} (path: experts), "
            f"the model {want}; build the model with the same layers and num_experts"
        )
    dense = torch.load(directory / "dense.pt", map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(dense, strict=False)
    prefixes = tuple(_expert_prefixes(model))
    missing = [k for k in missing if not k.startswith(prefixes)]
    if missing or unexpected:
        raise ValueError(
            f"load_checkpoint: dense state does not fit the model: missing {missing}, "
            f"unexpected {unexpected}"
        )
    for name, layer in layers.items():
        for gid, expert in zip(layer.experts.global_ids, layer.experts.local_experts):
            state = torch.load(_file(directory, name, gid), map_location="cpu", weights_only=True)
            expert.load_state_dict(state)
