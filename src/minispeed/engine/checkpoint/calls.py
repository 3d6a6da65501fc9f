"""DeepSpeed's `save_checkpoint` / `load_checkpoint` calls, written once for every engine.

`Engine` (and `MoEEngine`) and `PipelineEngine` answer a script's checkpoint calls the same way,
so the part a script sees lives here: DeepSpeed 0.19.8's signatures, the arguments refused, the
default tag `global_step<N>`, waiting for an asynchronous save in flight, `(None, None)` and a
warning for a directory with no `latest` file, and the path returned. What an engine writes
and restores is its own: `_save_part` and `_load_part`.

The path `load_checkpoint` returns is DeepSpeed's (`runtime/engine.py` `_get_ckpt_name`, the
file its `_load_checkpoint` opens first): `<tag dir>/mp_rank_<m>_model_states.pt`, or
`zero_pp_rank_<d>_mp_rank_<m>_model_states.pt` at ZeRO stage 3, with `m` the rank among the
pipeline × tensor ranks of this data rank (`mp_rank_00` without them) and `d` the data rank.
Scripts compare it with None, log it, or take its directory (the tag directory); minispeed's
layout (`grid.py`) has no file of that name, so opening it is the one thing that does
not work as under DeepSpeed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import minispeed.comm as comm
import minispeed.engine.checkpoint.background as ckpt_async
import minispeed.engine.checkpoint.grid as ckpt
from minispeed.core.logging import get_logger
from minispeed.zero.checkpoints import LATEST_FILE

__all__ = ["CheckpointCalls", "Restore", "ds_states_name"]

_log = get_logger("engine")


def ds_states_name(place: ckpt.GridPlace, zero_stage: int) -> str:
    """The name of the model-states file DeepSpeed's `load_checkpoint` returns the path of, for
    the rank at `place` (see the module docstring)."""
    mp = f"mp_rank_{place.stage * place.tensor + place.tensor_rank:02d}"
    if zero_stage == 3:
        return f"zero_pp_rank_{place.data_rank}_{mp}_model_states.pt"
    return f"{mp}_model_states.pt"


@dataclass(frozen=True)
class Restore:
    """What `load_checkpoint` restores besides the weights, from DeepSpeed's arguments."""

    optimizer: bool  # the optimizer states: load_optimizer_states and not load_module_only
    scheduler: bool  # the scheduler's state: load_lr_scheduler_states and not load_module_only
    counters: bool  # the step and sample counters: not load_module_only
    strict: bool = True  # load_module_strict: False lets the frozen parameters differ


class CheckpointCalls:
    """Mixed into the engines: expects `global_steps`, `config` (for `checkpointer_of`),
    `zero_optimization_stage()`, and the two methods below."""

    global_steps: int

    def _save_part(
        self,
        save_dir: str | os.PathLike,
        tag: str,
        client: dict[str, Any],
        save_latest: bool,
        exclude_frozen: bool = False,
    ) -> None:
        """Save this rank's part under `save_dir/tag` (collective)."""
        raise NotImplementedError

    def _load_part(
        self, load_dir: str | os.PathLike, tag: str | None, restore: Restore
    ) -> tuple[Path, dict[str, Any] | None]:
        """Restore this rank's part (collective); returns (tag directory, client state)."""
        raise NotImplementedError

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save model, optimizer, scheduler and counters under `save_dir/tag` (collective).

        `tag` defaults to `global_step<N>`; every rank must name the same one, checked as
        `checkpoint.tag_validation` says. `client_state` comes back from `load_checkpoint`.
        `save_dir` None or empty is a `ValueError`, as DeepSpeed's.
        `latest` moves last, once every rank's files are durable (unless `save_latest=False`).
        With `checkpoint.async_save` the files are written in the background and this returns
        after the host copy (`background.py`).
        `exclude_frozen_parameters=True` leaves the parameters without `requires_grad` out (a
        LoRA's frozen base model, as the Trainer saves a PEFT model); such a tag loads with
        `load_module_strict=False`, the model keeping its own frozen values.
        """
        if save_dir is None or not os.fspath(save_dir):
            raise ValueError(
                f"save_checkpoint(save_dir={save_dir!r}): give the directory to save into (it "
                "is created if missing), as DeepSpeed requires"
            )
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        self._validate_tag(tag)
        self._save_part(
            save_dir, tag, dict(client_state or {}), save_latest, exclude_frozen_parameters
        )
        return True

    def _validate_tag(self, tag: str) -> None:
        """`checkpoint.tag_validation`: every rank must name the same tag (DeepSpeed's check;
        one gather of the tags, on every rank, so `"FAIL"` raises on every rank)."""
        mode = ckpt_async.checkpointer_of(self).config.tag_validation.upper()
        if mode == "IGNORE":
            return
        tags = comm.all_gather_object(tag)
        if len(set(tags)) == 1:
            return
        message = (
            f"save_checkpoint: the ranks name different tags ({tags}, by rank); a tag holding "
            "rank-specific text cannot be loaded at another world size. Pass the same tag on "
            "every rank (checkpoint.tag_validation is " + mode + ")"
        )
        if mode == "FAIL":
            raise ValueError(message)
        _log.warning(message)

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Restore what `save_checkpoint` wrote; returns `(load_path, client_state)`.

        `load_path` is DeepSpeed's (the module docstring). `tag=None` reads `load_dir/latest`;
        with no `latest` file this returns `(None, None)` with a warning, as DeepSpeed does.
        Loads at any data-parallel size; another pipeline or expert-parallel size is refused
        naming both grids. A directory DeepSpeed itself wrote (ZeRO 0-3, data-parallel) loads
        too, with DeepSpeed's client state (`deepspeed_files.py`), and so does a DeepSpeed
        universal folder (`universal.py`; with `checkpoint.load_universal`, `tag=None` reads
        `latest_universal`). Waits for an asynchronous save in flight first.
        `load_module_strict=False` lets the frozen parameters differ from the checkpoint's:
        those it lacks keep the model's values, those the model lacks are skipped (trainable
        ones must still match, since their optimizer state is loaded with them).
        """
        saver = ckpt_async.checkpointer_of(self)
        saver.wait()  # a save in flight lands (and moves `latest`)
        if tag is None and not ckpt.has_latest(load_dir, saver.config.load_universal):
            _log.warning(
                "no '%s' file in %s: nothing loaded; pass tag= to load a tag",
                LATEST_FILE,
                os.fspath(load_dir),
            )
            return None, None
        restore = Restore(
            optimizer=load_optimizer_states and not load_module_only,
            scheduler=load_lr_scheduler_states and not load_module_only,
            counters=not load_module_only,
            strict=load_module_strict,
        )
        tag_dir, client = self._load_part(load_dir, tag, restore)
        place = ckpt_async.place_of(self)
        name = ds_states_name(place, self.zero_optimization_stage())  # type: ignore[attr-defined]
        return os.fspath(tag_dir / name), client
