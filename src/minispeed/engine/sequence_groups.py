"""The sequence-parallel grid (data × sequence) and the one registry of it that DeepSpeed's
`parallel_state_sp`, `deepspeed.utils.groups` and the engine read.

```text
rank = data · S + sequence          sequence fastest (DeepSpeed's parallel_state_sp layout)
4 ranks, S = 2 (D = 2):
sequence groups [0,1] [2,3]    data groups [0,2] [1,3]    sequence-data group [0,1,2,3]
```

DeepSpeed-Ulysses (`minispeed.tensor_parallel.ulysses`) splits each sequence over the S ranks
of a sequence group; every rank holds the whole model. So all D · S ranks of the sequence-data
group hold the same parameters: ZeRO shards over that group and reduces gradients over it,
summing or averaging over the sequence ranks as DeepSpeed does at each stage (Note [DeepSpeed's
sequence-parallel reduction]). The batch arithmetic counts D replicas:
`train_batch_size = micro · gas · D`.

Only data × sequence is built: sequence parallelism with pipeline or tensor parallelism is
refused (`check_sequence_grid`). Building it is collective (two `new_group` per axis line). The
registry lives as long as the world it was built in: after the default process group is torn
down it reads as empty. See `docs/architecture.md` (the process grid).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import minispeed.comm as comm
from minispeed.core.config import ConfigError

__all__ = [
    "SequenceGroups",
    "check_sequence_grid",
    "check_world_divides",
    "current",
    "initialize_sequence_parallel",
    "release",
    "require",
    "sequence_gradient_factor",
    "sequence_parallel_size",
    "sequence_size",
    "size_from_mpu",
]


@dataclasses.dataclass(frozen=True)
class SequenceGroups:
    """The data × sequence grid of one world, and the groups DeepSpeed names."""

    grid: comm.ProcessGrid  # axes ("data", "sequence"), sequence fastest
    world: Any  # the default group it was built in (the registry's validity)

    @property
    def sequence_group(self) -> Any:
        """The S ranks that split one sequence (this rank's)."""
        return self.grid.group("sequence")

    @property
    def sequence_data_group(self) -> Any:
        """The D · S ranks holding the same parameters: the world (only data × sequence is built)."""
        return self.world

    @property
    def sequence_parallel_size(self) -> int:
        return self.grid.size("sequence")

    @property
    def data_parallel_size(self) -> int:
        return self.grid.size("data")


_current: SequenceGroups | None = None


def sequence_size(value: Any) -> int | None:
    """The ds_config's `sequence_parallel_size`: a positive integer, or null (null or 1: off).
    Whether the world divides by it is checked where the world is known (`grid_shape`)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"must be a positive integer (1: no sequence parallelism), got {value!r}")
    return value


def sequence_parallel_size(ds: Any, mpu: Any) -> int:
    """S for `initialize`: the ds_config's key and an `mpu=`'s sequence group, which must agree
    when both are given (DeepSpeed reads the mpu's). Local."""
    given = ds.get("sequence_parallel_size")
    try:
        from_config = 1 if given is None else sequence_size(given)
    except ValueError as e:
        raise ConfigError("sequence_parallel_size", str(e)) from None
    if mpu is None:
        return from_config
    from_mpu = size_from_mpu(mpu)
    if given is not None and from_config != from_mpu:
        raise ConfigError(
            "sequence_parallel_size",
            f"{from_config} in the config, but the mpu's sequence-parallel group has {from_mpu} "
            f"ranks; make them equal (or leave the key out: the mpu's is used)",
        )
    return from_mpu


def check_world_divides(sequence_parallel_size: int, world_size: int) -> None:
    """S must divide the world (data x sequence is all of it): a `ConfigError` naming the sizes
    that fit. Local, every rank alike."""
    if world_size % sequence_parallel_size:
        fits = [s for s in range(1, world_size + 1) if world_size % s == 0]
        raise ConfigError(
            "sequence_parallel_size",
            f"{sequence_parallel_size} does not divide the world of {world_size} processes: "
            f"data x sequence must equal the world size; pick one of {fits}, or launch a "
            f"multiple of {sequence_parallel_size} processes",
        )


def initialize_sequence_parallel(sequence_parallel_size: int) -> SequenceGroups:
    """Build the data × sequence grid over the world and make it the registry's (DeepSpeed's
    `parallel_state_sp.initialize_sequence_parallel`). Collective: every rank, same size.
    Raises `ConfigError` (every rank alike) if the size is not > 1 or does not divide the world,
    `RuntimeError` if this world has one already."""
    global _current
    world = comm.get_world_size()
    try:
        sequence_size(sequence_parallel_size)
    except ValueError as e:
        raise ConfigError("sequence_parallel_size", str(e)) from None
    if sequence_parallel_size == 1:
        raise ConfigError(
            "sequence_parallel_size", "must be greater than 1 to build sequence-parallel groups"
        )
    check_world_divides(sequence_parallel_size, world)
    if current() is not None:
        raise RuntimeError(
            "the sequence-parallel groups of this world are initialized already; call "
            "initialize_sequence_parallel once per process group"
        )
    shape = {"data": world // sequence_parallel_size, "sequence": sequence_parallel_size}
    grid = comm.ProcessGrid(comm.ProcessTopology(list(shape), list(shape.values())))
    _current = SequenceGroups(grid, comm.world_group())
    return _current


def current() -> SequenceGroups | None:
    """The registry's groups, or None when none were built in the current world."""
    if _current is not None and _current.world is not comm.world_group():
        return None  # built in a world since torn down
    return _current


def require(what: str) -> SequenceGroups:
    """`current()`, or a `RuntimeError` naming `what` asked and how to build them."""
    groups = current()
    if groups is None:
        raise RuntimeError(
            f"{what}: no sequence-parallel groups exist; call deepspeed.runtime.sequence_parallel."
            "parallel_state_sp.initialize_sequence_parallel(S) (or set sequence_parallel_size in "
            "the config and call deepspeed.initialize) first"
        )
    return groups


def release() -> None:
    """Forget the registry's groups (DeepSpeed's `_release_sequence_parallel_groups`)."""
    global _current
    _current = None


def size_from_mpu(mpu: Any) -> int:
    """S from an `mpu=` object (`parallel_state_sp`, Megatron's parallel state): it must answer
    `get_sequence_parallel_world_size()` and, when S > 1, hold a sequence-data group of the whole
    world (only data × sequence is supported). Local."""
    if not callable(getattr(mpu, "get_sequence_parallel_world_size", None)):
        raise ValueError(
            f"mpu={type(mpu).__name__}: minispeed accepts an mpu only for sequence parallelism "
            "(an object with get_sequence_parallel_world_size / _group / _rank and "
            "get_sequence_data_parallel_*, as deepspeed.runtime.sequence_parallel."
            "parallel_state_sp); it builds its pipe x data x tensor grid from the config"
        )
    size = int(mpu.get_sequence_parallel_world_size())
    if size > 1:
        sdp = int(mpu.get_sequence_data_parallel_world_size())
        if sdp != comm.get_world_size():
            raise ValueError(
                f"mpu: the sequence-data-parallel group has {sdp} ranks, the world "
                f"{comm.get_world_size()}; minispeed supports data x sequence over the whole "
                "world only (no tensor or pipeline axis beside it)"
            )
    return size


def check_sequence_grid(
    sequence: int, pipe: int, tensor: int, experts: bool, mics_shard_size: int = -1
) -> None:
    """Sequence parallelism composes with data parallelism and ZeRO 0-3 only: a `ConfigError`
    naming the keys otherwise. Local, on every rank alike."""
    if sequence <= 1:
        return
    if mics_shard_size > 0:
        raise ConfigError(
            "sequence_parallel_size",
            "sequence parallelism with zero_optimization.mics_shard_size is not supported (MiCS "
            "cuts the data axis; ZeRO here runs over data x sequence); drop one of the two keys",
        )
    if pipe > 1:
        raise ConfigError(
            "sequence_parallel_size",
            f"sequence parallelism ({sequence}) with a {pipe}-stage PipelineModule is not "
            "supported; use a plain nn.Module, or drop sequence_parallel_size",
        )
    if tensor > 1:
        raise ConfigError(
            "sequence_parallel_size",
            f"sequence parallelism ({sequence}) with tensor_parallel.autotp_size={tensor} is not "
            "supported; drop one of the two keys",
        )
    if experts:
        raise ConfigError(
            "sequence_parallel_size",
            "sequence parallelism with MoE layers is not supported (expert groups are built over "
            "the world, not the data axis); drop sequence_parallel_size or the experts",
        )


def sequence_gradient_factor(zero: Any, sequence: int) -> int:
    """What the engine multiplies each loss by before backward under `sequence`-way sequence
    parallelism, so that ZeRO's mean over the D · S ranks becomes DeepSpeed's reduction at
    `zero`'s stage (Note [DeepSpeed's sequence-parallel reduction]): S where DeepSpeed sums
    over the sequence ranks, 1 where it averages over them."""
    if sequence <= 1:
        return 1
    if zero.stage == 3 and (zero.reduce_scatter or not zero.contiguous_gradients):
        return 1
    return sequence


# Note [DeepSpeed's sequence-parallel reduction]
# Each rank of a sequence group computes the gradient of its own T/S tokens' loss; the D x S ranks
# of the sequence-data group then reduce them. DeepSpeed 0.19.8 divides that sum by
# D = (D x S) / S in the engine's all-reduce (stage 0) and in ZeRO 1-2 (`average_tensor`), and in
# ZeRO-3's contiguous path (`reduce_scatter: false`): the sequence ranks' gradients are summed,
# the replicas averaged. ZeRO-3's default reduce-scatter (`__avg_scatter_grads`) divides by
# D x S instead: the sequence ranks' gradients are averaged. Recorded: scripts/record_ds_ulysses.py
# gives stage 3 half the gradients of stages 0-2 (tests/engine/fixtures/ds_ulysses.json).
# minispeed's ZeRO divides by its group's size, D x S, at every stage; where DeepSpeed sums, the
# engine multiplies the loss by S before backward (exact when S is a power of two: a scaling by
# 2^k commutes with rounding). So with a per-rank loss that is its share of the whole sequence's
# mean (its tokens' sum / all T tokens), stages 0-2 train as the unsplit model; with a per-rank
# mean over its T/S tokens (Megatron's), ZeRO-3 does, and stages 0-2 get S times that gradient,
# all as in DeepSpeed. The loss `backward` returns is not multiplied. The global gradient norm
# (clipping, get_global_grad_norm) is the reduced gradients', in both: S times the whole mean's at
# stages 0-2 with per-rank means (recorded with clipping, 2 micro-batches and bf16).
