"""`deepspeed.checkpoint` and `deepspeed.checkpoint.utils` (named `ds_checkpoint` here because
`minispeed.engine.checkpoint` is the engine's own checkpoint code): what clients take from it.

`clone_tensors_for_torch_save(item, device=torch.device("cpu"))`: `item` (a tensor, or nested
lists, tuples and dicts of them, a state dict) with every tensor detached and copied to `device`
(cloned where it is there already), so `torch.save` writes each tensor's own bytes instead of
the whole storage a view points into (accelerate calls it for `save_model` at ZeRO stages 0-2).
DeepSpeed's universal-checkpoint tools (`DeepSpeedCheckpoint`, `ds_to_universal`, the reshape
helpers) are not provided: minispeed's checkpoints load at any world size as they are
(`docs/engine/checkpoints.md`), and `minispeed consolidate` writes one fp32 file. Cost: one copy
of every tensor in `item`.
"""

from __future__ import annotations

from typing import Any

import torch

from minispeed.core.nested import map_tensors

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """`item` with each tensor detached and copied onto `device` (module docstring)."""
    device = torch.device(device)
    return map_tensors(
        item, lambda t: t.detach().clone() if t.device == device else t.detach().to(device)
    )
