"""The engine's MoE steps: which process group each optimizer param group is reduced over, and
`MoEEngine`, whose checkpoints keep every rank's experts.

DeepSpeed's engine reduces a parameter marked `allreduce=False` (an expert) over the
expert-data group of its `group_name`, divided by the data-parallel size, and its ZeRO-1/2
optimizer partitions a param group marked `moe=True` over that expert-data group. minispeed
recognises experts by the package's type: the parameters of each `minispeed.moe.MoE` layer's
experts (`layer.experts`; DeepSpeed's adapter `minispeed.engine.moe.layer.MoE` holds one such
layer), reduced over that layer's `groups.expert_data_group`. `expert_replica_groups` gives
`zero.shard` one replica group per param group (Note [replica groups] in minispeed.zero's
replica_groups.py): the expert-data group of the param group's experts, or `None` (the data
group) for dense parameters. `zero.shard` starts each param group equal over its replica group;
the frozen parameters (in no param group) it cannot place, so `broadcast_frozen` does, as
DeepSpeed's `_broadcast_model`: an expert's from the first rank of its expert-data group, any
other from the data group's first rank.

Checked locally on every rank before any collective: a param group mixing experts with dense
parameters (or experts of different expert-parallel degrees) cannot be reduced over one group,
and is an error naming the fix, as DeepSpeed asserts under ZeRO.

Note [expert checkpoints until the layout names experts]
`zero.save_checkpoint` names every piece by its parameter's `named_parameters()` name and
writes a piece held by several ranks once (stage 0: by the lowest rank). Expert parameters break
that assumption: rank 0's `...local_experts.0.weight` is expert 0 and rank 1's is expert 2 (with
E_p = 2), the same name for different tensors. So the zero files hold rank 0's experts only, and
loading them would give every expert rank rank 0's experts. Until the checkpoint layout names
expert pieces by their global expert index (issue 20 §4: files by pipeline stage, data rank and
expert rank), this engine adds one file per rank to the tag, `moe_rank_state.rank<R>-of-<W>.pt`
holding `ZeroOptimizer.state_dict()` (this rank's masters and optimizer state: Ψ/N·(4 + K)
bytes for stages 1-2, Ψ·(4 + K) for stage 0), written before the zero files seal the tag, and
restores it after `zero.load_checkpoint`: same world size, stage and expert-parallel degree only
(another layout is refused by `ZeroOptimizer.load_state_dict`, naming the difference).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import minispeed.comm
import minispeed.moe
from minispeed.core.files import atomic_write
from minispeed.engine.checkpoint.calls import Restore
from minispeed.engine.engine import Engine
from minispeed.zero.bucketed_setup import broadcast_from_first_rank, frozen_parameters
from minispeed.zero.replica_groups import broadcast_within

__all__ = ["MoEEngine", "broadcast_frozen", "expert_replica_groups"]


def expert_replica_groups(
    model: nn.Module, param_groups: Sequence[dict[str, Any]]
) -> list[Any] | None:
    """Per param group, the expert-data process group of its experts (`None`: dense); `None`
    overall when the model has no `minispeed.moe.MoE` layer."""
    layers = minispeed.moe.moe_layers(model)
    if not layers:
        return None
    # Layers of one expert-parallel degree have equal expert-data groups (the same ranks): the
    # first one serves. Each expert parameter maps to its layer's degree.
    by_degree: dict[int, Any] = {}
    degree_of: dict[int, int] = {}
    for layer in layers:
        degree = layer.groups.expert_parallel_degree
        by_degree.setdefault(degree, layer.groups.expert_data_group)
        for p in layer.experts.parameters():
            degree_of[id(p)] = degree
    replica_groups: list[Any] = []
    for g, group in enumerate(param_groups):
        kinds = {degree_of.get(id(p)) for p in group["params"]}
        if len(kinds) > 1:
            named = sorted("dense" if k is None else f"experts of ep_size {k}" for k in kinds)
            raise ValueError(
                f"optimizer param group {g} holds parameters of {named}: expert parameters are "
                "reduced over their expert-data group and dense ones over the data group, so "
                "each group must hold one kind. Build the groups with minispeed.moe."
                "dense_parameters / expert_parameters, or with DeepSpeed's minispeed.engine.moe."
                "utils.split_params_into_different_moe_groups_for_optimizer (as DeepSpeed requires)"
            )
        degree = next(iter(kinds), None)
        replica_groups.append(None if degree is None else by_degree[degree])
    return replica_groups


def broadcast_frozen(model: nn.Module, param_groups: Sequence[dict[str, Any]]) -> None:
    """Start the parameters in no param group equal where their copies live (collective over
    the world): experts over their layer's expert-data group, the rest over the data group, each
    from its first rank. Ψ_frozen·bytes sent, once."""
    if not minispeed.comm.is_initialized():
        return
    frozen = {id(p) for p in frozen_parameters(model, [g["params"] for g in param_groups])}
    by_degree: dict[int, tuple[Any, list[nn.Parameter]]] = {}
    for layer in minispeed.moe.moe_layers(model):
        degree = layer.groups.expert_parallel_degree
        _, part = by_degree.setdefault(degree, (layer.groups.expert_data_group, []))
        part += [p for p in layer.experts.parameters() if id(p) in frozen]
    experts = {id(p) for _, ps in by_degree.values() for p in ps}
    dense = [p for p in model.parameters() if id(p) in frozen and id(p) not in experts]
    parts = [(None, dense), *by_degree.values()]
    parts = [(g, ps) for g, ps in parts if ps]  # every rank freezes alike: no collective for none
    broadcast_within(
        [ps for _, ps in parts], [g for g, _ in parts], None, broadcast_from_first_rank
    )


def _rank_file(tag_dir: Path, group: Any) -> Path:
    rank, world = minispeed.comm.get_rank(group), minispeed.comm.get_world_size(group)
    return tag_dir / f"moe_rank_state.rank{rank}-of-{world}.pt"


class MoEEngine(Engine):
    """`Engine` whose checkpoints also hold each rank's own optimizer state (Note [expert
    checkpoints until the layout names experts])."""

    def _save_part(
        self,
        save_dir: str | os.PathLike,
        tag: str,
        client: dict[str, Any],
        save_latest: bool,
        exclude_frozen: bool = False,
    ) -> None:
        """`Engine`'s files, plus this rank's `moe_rank_state` file (collective)."""
        opt = self._require_optimizer("save_checkpoint")
        path = _rank_file(Path(save_dir) / tag, opt.comm_group)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = opt.state_dict()
        atomic_write(path, lambda f: torch.save(state, f))  # the zero files seal the tag after
        super()._save_part(save_dir, tag, client, save_latest, exclude_frozen)

    def save_16bit_model(
        self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin"
    ) -> bool:
        """Refused while experts are spread over ranks: one `state_dict` file would hold rank 0's
        experts only, under local names that another rank's experts also use."""
        spread = [
            m.groups.expert_parallel_degree
            for m in minispeed.moe.moe_layers(self.module)
            if m.groups.expert_parallel_degree > 1
        ]
        if spread:
            raise NotImplementedError(
                f"save_16bit_model of a model whose MoE layers spread experts over ranks "
                f"(ep_size={spread[0]}) is not implemented: its one file would hold rank 0's "
                "experts only. Use save_checkpoint (every rank's experts), or ep_size=1"
            )
        return super().save_16bit_model(save_dir, save_filename)

    def _load_part(
        self, load_dir: str | os.PathLike, tag: str | None, restore: Restore
    ) -> tuple[Path, dict[str, Any] | None]:
        """`Engine`'s part, then this rank's experts (and, with the optimizer states, its whole
        optimizer state) from its `moe_rank_state` file (collective)."""
        path, client = super()._load_part(load_dir, tag, restore)
        opt = self._require_optimizer("load_checkpoint")
        rank_file = _rank_file(path, opt.comm_group)
        if not rank_file.is_file():
            raise FileNotFoundError(
                f"{rank_file} is missing: a checkpoint of a model with MoE layers holds one "
                "moe_rank_state file per rank (saved by MoEEngine.save_checkpoint at the same "
                "world size); load it with the world size that saved it"
            )
        saved = torch.load(rank_file, map_location="cpu", weights_only=False)
        if restore.optimizer:
            opt.load_state_dict(saved)
            return path, client
        opt.load_state_dict(saved, masters_only=True)  # this rank's masters, published
        return path, client
