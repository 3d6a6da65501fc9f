"""Stages 1 and 2: fp32 masters and optimizer state partitioned over N ranks; stage 2 also
partitions the gradients.

Per optimizer param group the parameters are laid out in one flat buffer (`flat.py`); the
model's parameters become views of it (Note [parameters are views of the flat buffer]). Each rank
owns one shard of every bucket; the inner optimizer steps one fp32 master tensor per parameter
fragment, a slice of that partition (Note [one master per fragment]).

Per step:

```text
backward   hooks copy grads into buckets ---> reduce-scatter ---> this rank's grad shards
             stage 1: only on the boundary micro-step (grads accumulate locally before),
                      in place: the shard of the full gradient buffer is the result;
             stage 2: every micro-step, so the full gradient never exists at once
step       inner optimizer on (master fragments, grad fragments): slices of the shards
publish    master shard -> param dtype -> all-gather per bucket, in place -> the flat buffer,
           i.e. straight into every model parameter
```

Bytes kept per rank (Ψ parameters padded to Ψ', N ranks; p, g = bytes per param / grad element;
K = optimizer state bytes per parameter, 8 for Adam; the fp32 master, `4`, is absent for fp32
parameters, where the master *is* this rank's shard of the flat parameter buffer):

- stage 1: Ψ'·p (params) + Ψ'·g (full grads; the reduced shards live inside) + Ψ'·(4 + K)/N
- stage 2: Ψ'·p (params) + Ψ'·g/N (grad partition) + staging buckets + Ψ'·(4 + K)/N

Bytes sent per optimizer step (ring, per rank): reduce-scatter (N-1)/N · Ψ'·g (times the number
of micro-steps for stage 2) + all-gather (N-1)/N · Ψ'·p. With `reduce_scatter=False` the
reduction is an all-reduce (twice the bytes). Exact per-call sums: `ledger.stage_collectives`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import minispeed.comm as comm
from minispeed.zero.bucketed import BucketedStrategy
from minispeed.zero.contract import ParamFragment
from minispeed.zero.flat import Bucket
from minispeed.zero.reducer import BackwardScatterReducer, BoundaryScatterReducer

__all__ = ["PartitionedStrategy"]

# Note [parameters are views of the flat buffer]
# `param.data` is set to a view of the group's flat buffer, so the all-gather after the step
# writes every parameter in place, with no copy and no second full-size buffer. The nn.Parameter
# objects stay the same (autograd leaves, hooks, user references all keep working); only their
# storage moves. Gradients are separate tensors made by autograd, copied out by the hooks.

# Note [one master per fragment]
# The inner optimizer gets one master tensor per *parameter* of each param group:
# `optimizer.param_groups[g]["params"][i]` is rank r's fragment of parameter i (the part of it
# that lies in rank r's shards; at most one piece, flat.py), a view into the flat partition, or
# an empty view where rank r holds none of it. Why not one tensor per bucket shard (fewer,
# larger tensors)? torch.optim keeps its scalar state per tensor: Adam's `step` drives the
# bias correction, and a parameter that gets no gradient on a step is skipped (`grad is None`)
# without advancing its count. A master shared by several parameters would give a skipped one
# its neighbours' count (issue 14: 4.8e-2 relative loss difference from step 4 on); a master per
# fragment keeps PyTorch's per-parameter semantics for every elementwise optimizer, exactly, and
# a parameter no rank used is skipped by setting its master's `.grad` to None, as in stages 0
# and 3. The partition stays one flat buffer: for fp32 parameters each master *is* a slice of
# this rank's shard of the flat parameter buffer (an alias, like stage 0's Note [fp32 stage 0 has
# no master copy]): the step updates this rank's parameter elements in place and publishing is an
# in-place all-gather around them, with no master copy (Ψ'·4/N bytes) and no cast copy. 16-bit
# parameters get fp32 masters, slices of one partition tensor, cast into their shard of the flat
# buffer before the all-gather. Gradients are the matching slices of the reduced bucket shards
# (the reducer's `reduced()`); padding belongs to no fragment and is never stepped. Cost: one
# optimizer call per fragment instead of per bucket (stage 0 and 3 pay the same).


class PartitionedStrategy(BucketedStrategy):
    """ZeRO stage 1 (optimizer state partitioned) or 2 (+ gradients partitioned).

    `grad_divisor`: what the reduced gradient sum is divided by (default: the size of `group`;
    Note [replica groups] in replica_groups.py). After `close()` the parameters stay views of
    the flat buffers (Note [parameters are views of the flat buffer]): valid tensors of their
    own shapes, sharing storage with nothing else the user sees.
    """

    partitions_grads = True  # master_grads() holds this rank's shard only: the norm needs a sum

    pad = True

    def _set_up(self, model: nn.Module, group: Any, grad_divisor: int | None) -> None:
        """Flat parameter buffers, master fragments (Note [one master per fragment]), the
        stage's reduce-scatter reducer."""
        config, precision = self.config, self.precision
        if config.stage not in (1, 2):
            raise ValueError(f"PartitionedStrategy implements stages 1 and 2, not {config.stage}")
        self.comm_group = group
        self.world_size = comm.get_world_size(group)
        self.rank = comm.get_rank(group)

        self.flat_params: list[torch.Tensor] = []  # [g]: 1-D, numel = layouts[g].numel, param dtype
        # [g]: 1-D fp32, numel = layouts[g].partition_numel; 16-bit parameters only (fp32: None).
        self._master_parts: list[torch.Tensor | None] = []
        # [g][i]: (bucket index, offset in the bucket shard, start in the parameter, numel).
        self._pieces: list[list[tuple[int, int, int, int]]] = []
        # [g][i]: 1-D fp32 view of parameter i's fragment. Note [one master per fragment].
        self._masters: list[list[torch.Tensor]] = []
        for ps, lay in zip(self.groups, self.layouts):
            device = ps[0].device if ps else torch.device("cpu")
            pieces = [(lay.bucket_of_param[i], 0, 0, 0) for i in range(len(ps))]
            for i, start, numel, offset in lay.shard_pieces(self.rank):
                bk = lay.buckets[lay.bucket_of_param[i]]
                pieces[i] = (bk.index, offset - bk.shard_offset, start, numel)
            part = None
            if precision.needs_master_copy:
                part = torch.zeros(lay.partition_numel, dtype=torch.float32, device=device)
                for i, start, numel, offset in lay.shard_pieces(self.rank):
                    # Masters come from the original (usually fp32) values, before the cast below.
                    part[offset : offset + numel].copy_(
                        ps[i].detach().reshape(-1)[start : start + numel]
                    )
            flat = torch.zeros(lay.numel, dtype=precision.param_dtype, device=device)
            for slot in lay.slots:
                view = flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
                view.copy_(ps[slot.param_index].detach())
                ps[
                    slot.param_index
                ].data = view  # See Note [parameters are views of the flat buffer]
            self.flat_params.append(flat)
            self._master_parts.append(part)
            self._pieces.append(pieces)
            masters = []
            for b, at, _, numel in pieces:
                bk = lay.buckets[b]
                shard = (
                    part[bk.shard_offset : bk.shard_offset + bk.shard_numel]
                    if part is not None
                    else bk.shard_of(flat, self.rank)
                )
                masters.append(shard[at : at + numel])
            self._masters.append(masters)

        reducer = BoundaryScatterReducer if config.stage == 1 else BackwardScatterReducer
        self._reduce_with(reducer, model, group, grad_divisor)

    def master_params(self) -> list[list[torch.Tensor]]:
        """Per group, one fp32 tensor per parameter: its fragment in this rank's partition."""
        return self._masters

    def master_grads(self) -> list[list[torch.Tensor]]:
        """Per group, per parameter: the fragment's slice of this rank's averaged fp32 gradient
        shard of its bucket (views: no copy)."""
        shards = self.reducer.reduced()
        return self._views_of(
            [t for ts in shards for t in ts],
            lambda: [
                [shards[g][b][at : at + numel] for b, at, _, numel in pieces]
                for g, pieces in enumerate(self._pieces)
            ],
        )

    @torch.no_grad()
    def publish_params(self) -> None:
        """All-gather every rank's updated partition into the flat buffers (= the parameters)."""
        pending: list[tuple[Any, Any]] = []
        for g, lay in enumerate(self.layouts):
            part = self._master_parts[g]
            for bk in lay.buckets:
                mine = bk.shard_of(self.flat_params[g], self.rank)
                if part is not None:  # 16-bit: cast into place (fp32: the masters are the shard)
                    mine.copy_(part[bk.shard_offset : bk.shard_offset + bk.shard_numel])
                pending.extend(self._gather_bucket(self.flat_params[g], mine, bk))
        for work, finish in pending:
            if work is not None:
                work.wait()
            if finish is not None:
                finish()

    def _gather_bucket(
        self, flat: torch.Tensor, mine: torch.Tensor, bk: Bucket
    ) -> list[tuple[Any, Any]]:
        """Issue the all-gather(s) that rebuild bucket `bk` around `mine` (this rank's shard,
        in place: Note [in-place flat collectives] in comm/api_compat.py); (work, finish) pairs."""
        n = self.world_size
        out = flat[bk.start : bk.start + bk.padded_numel]  # (N * shard,) = N shards side by side
        chunk = max(1, self.config.allgather_bucket_numel // n)  # input elements per call
        if bk.shard_numel <= chunk:
            return [
                (comm.all_gather_into_tensor(out, mine, group=self.comm_group, async_op=True), None)
            ]
        # A bucket larger than allgather_bucket_numel: gather column chunks of the (N, shard) grid
        # through a temporary, since column j of every shard is not contiguous in `out`.
        grid = out.view(n, bk.shard_numel)
        issued = []
        for j in range(0, bk.shard_numel, chunk):
            piece = mine[j : j + chunk]
            tmp = torch.empty(n * piece.numel(), dtype=out.dtype, device=out.device)
            work = comm.all_gather_into_tensor(tmp, piece, group=self.comm_group, async_op=True)
            cols = slice(j, j + piece.numel())
            issued.append((work, lambda tmp=tmp, cols=cols: grid[:, cols].copy_(tmp.view(n, -1))))
        return issued

    def fragments(self) -> list[ParamFragment]:
        """The piece of each parameter inside this rank's partition (numel 0 where none); the
        master of parameter i of group g holds exactly that piece."""
        return [
            ParamFragment(self.names[p], p.shape, start, numel, g, i, 0)
            for g, (ps, pieces) in enumerate(zip(self.groups, self._pieces))
            for i, (p, (_, _, start, numel)) in enumerate(zip(ps, pieces))
        ]

    def gather_numels(self) -> list[int]:
        """Output elements of each parameter all-gather call (for the ledger)."""
        chunk = max(1, self.config.allgather_bucket_numel // self.world_size)
        sizes = []
        for lay in self.layouts:
            for bk in lay.buckets:
                for j in range(0, bk.shard_numel, chunk):
                    sizes.append(self.world_size * min(chunk, bk.shard_numel - j))
        return sizes
