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
for checkpoints saved at any data-parallel size, and reads a checkpoint DeepSpeed itself wrote
(stages 0-3; `minispeed.engine.checkpoint.deepspeed_files`, which first joins its flat
partitions per parameter into a temporary one-rank checkpoint: Ψ·(4 + K) more bytes read). A checkpoint of several parts (pipeline stages
or expert ranks: `minispeed.engine.checkpoint`) is refused naming its parts: consolidate each
part directory, as each holds its own layers. `lazy_mode=True` and `safe_serialization=True` are
refused.

`convert_zero_checkpoint_to_state_dict` writes the weights in fp32, fp16 or bf16 (`dtype`), as
`pytorch_model.bin` or `model.safetensors`, cut into shards of at most `max_shard_size` with an
index file (Hugging Face's layout, so `from_pretrained` reads the folder) when the weights are
larger; each file is written atomically. Disk: Ψ·4 bytes of temporary fp32 file, then the
output; host memory: one shard (the fp32 file is memory-mapped).

`save_checkpoint` writes `zero_to_fp32.py` and `zero_to_torch.py` beside the tag folders, as
DeepSpeed does, so the command DeepSpeed's users run in a checkpoint folder works unchanged:

```bash
python zero_to_fp32.py . out/                      # out/pytorch_model.bin, fp32
python zero_to_torch.py . out/ --dtype bf16        # bf16 weights
```

(`python -m minispeed.engine.utils.zero_to_fp32 CKPT OUT` is the same command.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn

import minispeed.zero as zero
from minispeed.core.files import atomic_replace, atomic_write, fsync_dir
from minispeed.engine.checkpoint.deepspeed_files import weights_tag_dir
from minispeed.engine.checkpoint.grid import find_tag, read_grid

__all__ = [
    "OUTPUT_DTYPE_NAMES",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
    "zero_tag_dir",
]

OUTPUT_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
"""The output dtypes by name (DeepSpeed's names); a `torch.dtype` among them is taken too."""

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@contextlib.contextmanager
def zero_tag_dir(checkpoint_dir: str | os.PathLike, tag: str | None) -> Iterator[Path]:
    """The tag directory to consolidate: minispeed's own, or, for a tag DeepSpeed wrote, its
    weights as a one-rank minispeed checkpoint in a temporary directory (removed on exit;
    `minispeed.engine.checkpoint.deepspeed_files.weights_tag_dir`)."""
    with weights_tag_dir(_tag_dir(checkpoint_dir, tag)) as tag_dir:
        yield tag_dir


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
    (no collective). `exclude_frozen_parameters` leaves the frozen parameters out."""
    if lazy_mode:
        raise ValueError("lazy_mode=True is not supported: the whole fp32 state dict is returned")
    with zero_tag_dir(checkpoint_dir, tag) as tag_dir, tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fp32.pt"
        zero.consolidate(tag_dir, out, exclude_frozen=exclude_frozen_parameters)
        state = torch.load(out, map_location="cpu", weights_only=True)
    return state


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's older name)."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir, output_dir, torch.float32, max_shard_size, safe_serialization, tag,
        exclude_frozen_parameters,
    )  # fmt: skip


def _output_dtype(dtype: str | torch.dtype) -> torch.dtype:
    name = dtype.removeprefix("torch.").lower() if isinstance(dtype, str) else dtype
    found = OUTPUT_DTYPE_NAMES.get(name) if isinstance(name, str) else name
    if found not in OUTPUT_DTYPE_NAMES.values():
        raise ValueError(
            f"unsupported output dtype {dtype!r}: choose one of "
            f"{', '.join(sorted(OUTPUT_DTYPE_NAMES))}"
        )
    return found


def shard_bytes(size: str | int | None) -> int | None:
    """`max_shard_size` in bytes: an int, or digits and a unit (`"5GB"` = 5·10⁹, `"500MiB"` =
    500·2²⁰, Hugging Face's reading); None means one file."""
    if size is None or isinstance(size, int):
        return size
    found = re.fullmatch(r"\s*(\d+)\s*([KMGT]?I?B?)\s*", size.upper())
    if found is None or found.group(2) not in _UNITS:
        raise ValueError(
            f"max_shard_size={size!r}: give a byte count, or digits and a unit such as "
            "'5GB' or '500MiB'"
        )
    return int(found.group(1)) * _UNITS[found.group(2)]


def _out_bytes(t: torch.Tensor, itemsize: int) -> int:
    """`t`'s bytes in the output: floating-point tensors at `itemsize`, others as they are."""
    return t.numel() * (itemsize if t.is_floating_point() else t.element_size())


def _shards(state: dict[str, torch.Tensor], limit: int | None, itemsize: int) -> list[list[str]]:
    """Cut the names, in order, into runs of at most `limit` bytes (a tensor larger than the
    limit gets a shard of its own)."""
    runs: list[list[str]] = [[]]
    used = 0
    for name, t in state.items():
        size = _out_bytes(t, itemsize)
        if limit is not None and runs[-1] and used + size > limit:
            runs.append([])
            used = 0
        runs[-1].append(name)
        used += size
    return runs


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    dtype: str | torch.dtype = torch.float32,
    max_shard_size: str | int | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write the checkpoint's weights into `output_dir` in `dtype` (floating-point tensors
    only; integer buffers keep theirs) and return the files written.

    One file, `pytorch_model.bin` (`model.safetensors` with `safe_serialization`), when the
    weights fit in `max_shard_size`; else `pytorch_model-00001-of-0000N.bin` and so on, plus
    `pytorch_model.bin.index.json` mapping each name to its file. Every file is written to a
    temporary name, fsynced and renamed, so a failure leaves no half-written output.
    `exclude_frozen_parameters` leaves the frozen parameters out."""
    dtype = _output_dtype(dtype)
    limit = shard_bytes(max_shard_size)
    if safe_serialization:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError(
                "safe_serialization=True needs the safetensors package: pip install safetensors"
            ) from None
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem, ext = ("model", ".safetensors") if safe_serialization else ("pytorch_model", ".bin")
    written: list[Path] = []
    with zero_tag_dir(checkpoint_dir, tag) as tag_dir, tempfile.TemporaryDirectory(dir=out) as tmp:
        whole = Path(tmp) / "fp32.pt"
        zero.consolidate(tag_dir, whole, exclude_frozen=exclude_frozen_parameters)
        state = torch.load(whole, map_location="cpu", weights_only=True, mmap=True)
        runs = _shards(state, limit, dtype.itemsize)
        if len(runs) == 1 and dtype == torch.float32 and not safe_serialization:
            del state  # the consolidated file is the output: moved, never copied
            os.replace(whole, out / f"{stem}{ext}")
            fsync_dir(out)
            return [out / f"{stem}{ext}"]
        names = [f"{stem}{ext}"] if len(runs) == 1 else [
            f"{stem}-{i + 1:05d}-of-{len(runs):05d}{ext}" for i in range(len(runs))
        ]  # fmt: skip
        for file, run in zip(names, runs, strict=True):
            # A copy per tensor: tied names must not share storage (safetensors refuses it),
            # and the memory-mapped fp32 file must not be what is saved.
            part = {n: state[n].to(dtype) if state[n].is_floating_point() else state[n]
                    for n in run}  # fmt: skip
            part = {n: t.clone() if t.data_ptr() == state[n].data_ptr() else t
                    for n, t in part.items()}  # fmt: skip
            with atomic_replace(out / file) as path:
                if safe_serialization:
                    save_file(part, str(path), metadata={"format": "pt"})
                else:
                    torch.save(part, path)
            written.append(out / file)
            del part
        if len(runs) > 1:
            index = {
                "metadata": {
                    "total_size": sum(_out_bytes(t, dtype.itemsize) for t in state.values())
                },
                "weight_map": {n: f for f, run in zip(names, runs, strict=True) for n in run},
            }
            index_file = out / f"{stem}{ext}.index.json"
            atomic_write(index_file, json.dumps(index, indent=2, sort_keys=True) + "\n")
            written.append(index_file)
        del state
    return written


def _parser(dtype_required: bool) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Turn a minispeed (DeepSpeed-API) checkpoint into PyTorch weights."
    )
    p.add_argument("checkpoint_dir", help="the folder save_checkpoint wrote (holds `latest`)")
    p.add_argument("output_dir", help="the folder for pytorch_model.bin (created if missing)")
    p.add_argument(
        "--dtype", required=dtype_required, default=None if dtype_required else "fp32",
        choices=sorted(OUTPUT_DTYPE_NAMES), help="the weights' dtype",
    )  # fmt: skip
    p.add_argument("--max_shard_size", default="5GB", help="largest file, e.g. 5GB or 500MB")
    p.add_argument("--safe_serialization", action="store_true", help="write .safetensors")
    p.add_argument("-t", "--tag", default=None, help="the tag folder (default: `latest`)")
    p.add_argument(
        "--exclude_frozen_parameters", action="store_true", help="leave the frozen parameters out"
    )
    p.add_argument("-d", "--debug", action="store_true", help="accepted, no effect")
    return p


def main(argv: Sequence[str] | None = None, *, dtype_required: bool = False) -> int:
    """The command DeepSpeed's `zero_to_fp32.py` offers: `CHECKPOINT_DIR OUTPUT_DIR [--tag T]
    [--max_shard_size S] [--safe_serialization] [--dtype D]` (fp32 unless `--dtype`)."""
    args = _parser(dtype_required).parse_args(argv)
    files = convert_zero_checkpoint_to_state_dict(
        args.checkpoint_dir, args.output_dir, dtype=args.dtype,
        max_shard_size=args.max_shard_size, safe_serialization=args.safe_serialization,
        tag=args.tag, exclude_frozen_parameters=args.exclude_frozen_parameters,
    )  # fmt: skip
    print(f"wrote {', '.join(str(f) for f in files)} ({args.dtype})")
    return 0


def load_state_dict_from_zero_checkpoint(
    model: nn.Module, checkpoint_dir: str | os.PathLike, tag: str | None = None
) -> nn.Module:
    """Move `model` to the CPU, load the checkpoint's fp32 weights into it and return it."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag))
    return model


if __name__ == "__main__":
    raise SystemExit(main())
