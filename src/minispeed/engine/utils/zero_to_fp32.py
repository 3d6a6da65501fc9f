"""DeepSpeed's `deepspeed.utils.zero_to_fp32`: a sharded engine checkpoint as one fp32 state dict.

```python
from minispeed.engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
state_dict = get_fp32_state_dict_from_zero_checkpoint("ckpt")   # `latest`, or tag=
model.load_state_dict(state_dict)
```

Over `minispeed.zero.consolidate` (the `minispeed consolidate` command): the weight shards are
streamed into one `torch.save` file, which is then loaded, so the cost is one pass over the
weight shards (never the optimizer moments), Ψ·4 bytes of disk in a temporary file and Ψ·4 bytes
of host memory for the returned dict. Works at every ZeRO stage (DeepSpeed's needs 1-3) and
for checkpoints saved at any data-parallel size. A checkpoint of several parts (pipeline stages
or expert ranks: `minispeed.engine.checkpoint`) is refused naming its parts: consolidate each
part directory, as each holds its own layers. `lazy_mode=True` and `safe_serialization=True` are
refused.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from torch import nn

import minispeed.zero as zero
from minispeed.engine.checkpoint.grid import find_tag, read_grid

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]


def _tag_dir(checkpoint_dir: str | os.PathLike, tag: str | None) -> Path:
    root = Path(checkpoint_dir)
    if tag is None and not (root / "latest").is_file():
        raise FileNotFoundError(
            f"{root} has no 'latest' file: pass tag= (the directory name under {root})"
        )
    tag_dir = find_tag(root, tag)
    grid = read_grid(tag_dir)
    if grid is not None and (grid["grid"]["pipe"] > 1 or grid["grid"]["expert"] > 1):
        parts = sorted(p.name for p in tag_dir.iterdir() if p.is_dir())
        raise ValueError(
            f"checkpoint {tag_dir} holds {len(parts)} parts ({', '.join(parts)}), one per "
            "pipeline stage / expert rank: consolidate each part directory on its own "
            "(get_fp32_state_dict_from_zero_checkpoint(tag_dir, tag=part))"
        )
    return tag_dir


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's `state_dict` with fp32 parameters, from the checkpoint `save_checkpoint`
    wrote under `checkpoint_dir` (`tag` defaults to `latest`). Read by the calling process only
    (no collective)."""
    if lazy_mode:
        raise ValueError("lazy_mode=True is not supported: the whole fp32 state dict is returned")
    if exclude_frozen_parameters:
        raise ValueError(
            "exclude_frozen_parameters=True is not supported: the checkpoint keeps frozen "
            "parameters; drop them from the returned dict"
        )
    tag_dir = _tag_dir(checkpoint_dir, tag)
    with tempfile.TemporaryDirectory(dir=tag_dir.parent) as tmp:
        out = Path(tmp) / "fp32.pt"
        zero.consolidate(tag_dir, out)
        state = torch.load(out, map_location="cpu", weights_only=True)
    return state


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: str = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write `output_dir/pytorch_model.bin` (one file, streamed: the weights are never all in
    memory; `max_shard_size` is accepted and unused)."""
    if safe_serialization:
        raise ValueError(
            "safe_serialization=True is not supported: the output is a torch.save file"
        )
    if exclude_frozen_parameters:
        raise ValueError("exclude_frozen_parameters=True is not supported; leave it False")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    zero.consolidate(_tag_dir(checkpoint_dir, tag), out / "pytorch_model.bin")


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike, tag: str | None = None
) -> nn.Module:
    """Move `model` to the CPU, load the checkpoint's fp32 weights into it and return it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag))
    return model
