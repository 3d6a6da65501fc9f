"""The ZeRO memory formulas, written once: the estimator, ``measure``, the tests and the docs
all call these functions.

From the ZeRO paper (Rajbhandari et al., 2020, §3 and §5). Notation:

- Ψ: number of model parameters (elements);
- N: data-parallel ranks;
- p, g: bytes per parameter / gradient element as the model holds them (2 for 16-bit
  training, 4 for fp32; gradients use ``MixedPrecision.grad_accum_dtype``);
- K: optimizer bytes per parameter: the fp32 master copy (4) plus the inner optimizer's
  per-element state S (Adam: momentum 4 + variance 4, so S = 8 and K = 12).

| stage | what is partitioned | bytes kept per rank (`model_state_bytes`) |
|---|---|---|
| 0 | nothing (data parallel) | p·Ψ + g·Ψ + K·Ψ (mixed Adam: 16Ψ) |
| 1 | optimizer states | p·Ψ + g·Ψ + K·Ψ/N (4Ψ + 12Ψ/N) |
| 2 | + gradients | p·Ψ + g·Ψ/N + K·Ψ/N (2Ψ + 14Ψ/N) |
| 3 | + parameters | p·Ψ/N + g·Ψ/N + K·Ψ/N (16Ψ/N) |
| 3, MiCS | the same, inside shard groups of S ranks, replicated N/S times | p·Ψ/S + g·Ψ/S + K·Ψ/S (16Ψ/S) |
| 3, no optimizer | parameters; nothing else exists | p·Ψ/N (16-bit: 2Ψ/N; `forward_only_state_bytes`) |

(MiCS, stage3/mics.py: every function here takes S in place of N, `world_size=S`.)

A partitioned tensor of ``n`` elements is padded to a multiple of N, so each rank holds
``ceil(n / N)`` elements; `padding_elements` bounds the slack. Stage 3 keeps parameters
below ``stage3_param_persistence_threshold`` whole on every rank ("persistent").

minispeed's stages keep exactly this, with two named differences
(`minispeed_state_bytes`, checked against live runs by ``tests/test_memory_ledger.py``):

1. fp32 training: the fp32 master *is* the parameter (stage 0), this rank's shard of the flat
   parameter buffer (stages 1-2) or the parameter shard (stage 3), so the 4 master bytes are not
   spent twice: K becomes S.
2. Stage 3 keeps a persistent parameter's shard besides its whole copy: p·Ψ_pers·(1 + 1/N).

Measured between the last backward of a window and its step, when every model state exists
(stage 3 creates its gradient shards during backward and drops them at the step).

These are *model states* only: activations (``activation.py``), communication buckets and
allocator fragmentation come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "MASTER_BYTES",
    "GiB",
    "ModelStateBytes",
    "forward_only_state_bytes",
    "hpz_secondary_bytes",
    "minispeed_state_bytes",
    "model_state_bytes",
    "optimizer_bytes_per_param",
    "padding_elements",
    "partition_numel",
]

GiB = 2**30

#: Bytes of the fp32 master copy every ZeRO stage keeps for each parameter it updates.
MASTER_BYTES = 4


def partition_numel(numel: int, world_size: int) -> int:
    """Elements each rank holds of an ``numel``-element tensor split N ways: ``ceil(numel / N)``."""
    return -(-numel // world_size)


def padding_elements(num_partitioned_tensors: int, world_size: int) -> int:
    """Most extra elements per rank that padding can add when that many tensors are split N ways.

    Each split tensor is padded to a multiple of N; a rank's share grows by at most one element
    per tensor (``ceil(n/N) - n/N < 1``).
    """
    return num_partitioned_tensors if world_size > 1 else 0


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-rank bytes of model states for one stage (see the table in the module docstring)."""

    stage: int
    world_size: int
    #: Model parameters in their working dtype (16-bit or fp32), whole or partitioned.
    params: int
    #: Gradients in the accumulation dtype, whole or partitioned.
    grads: int
    #: fp32 master weights plus the inner optimizer's per-element state (K bytes per parameter).
    optimizer: int

    @property
    def total(self) -> int:
        """Sum of the three columns."""
        return self.params + self.grads + self.optimizer


def model_state_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
    persistent_params: int = 0,
    trainable_params: int | None = None,
) -> ModelStateBytes:
    """The ZeRO paper's per-rank bytes for ``stage`` (0-3): the one implementation of the formulas.

    ``num_params`` = Ψ, ``world_size`` = N, ``param_bytes`` = p, ``grad_bytes`` = g,
    ``optimizer_bytes`` = K. Partitioned columns use ``ceil(Ψ/N)`` elements (one padded split; use
    `padding_elements` for the slack of many). ``persistent_params`` (stage 3 only): elements
    kept whole on every rank. ``trainable_params``: elements that have gradients and optimizer
    state (default: all of Ψ); frozen parameters add to the parameter column only.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_params < 0 or persistent_params < 0 or persistent_params > num_params:
        raise ValueError(
            f"need 0 <= persistent_params ({persistent_params}) <= num_params ({num_params})"
        )
    trainable = num_params if trainable_params is None else trainable_params
    if not 0 <= trainable <= num_params:
        raise ValueError(f"need 0 <= trainable_params ({trainable}) <= num_params ({num_params})")

    def split(n: int, partitioned: bool) -> int:
        return partition_numel(n, world_size) if partitioned else n

    if stage == 3:
        param_elems = persistent_params + split(num_params - persistent_params, True)
    else:
        param_elems = num_params
    return ModelStateBytes(
        stage=stage,
        world_size=world_size,
        params=param_bytes * param_elems,
        grads=grad_bytes * split(trainable, stage >= 2),
        optimizer=optimizer_bytes * split(trainable, stage >= 1),
    )


def optimizer_bytes_per_param(optimizer: torch.optim.Optimizer | type) -> int:
    """K for a torch.optim optimizer: the fp32 master (4) plus its fp32 per-element state.

    Adam/AdamW: + exp_avg + exp_avg_sq (8; + max_exp_avg_sq with amsgrad). SGD: + momentum_buffer
    when momentum > 0. Adagrad: + sum. RMSprop: + square_avg (+ momentum_buffer, + grad_avg when
    centered). Read from the first param group's hyper-parameters when given an instance. A class
    that is none of these may say how many fp32 state tensors of a parameter's size it keeps
    (`state_tensors_per_param`, as offload's CPU optimizers do).
    """
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    group = {} if isinstance(optimizer, type) else optimizer.param_groups[0]
    declared = getattr(cls, "state_tensors_per_param", None)
    if declared is not None:
        state = int(declared)
    elif issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        state = 3 if group.get("amsgrad", False) else 2
    elif issubclass(cls, torch.optim.SGD):
        state = 1 if group.get("momentum", 0) else 0
    elif issubclass(cls, torch.optim.Adagrad):
        state = 1
    elif issubclass(cls, torch.optim.RMSprop):
        state = 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    else:
        raise ValueError(
            f"optimizer_bytes_per_param does not know {cls.__name__}; pass optimizer_bytes=K "
            "(4 for the fp32 master + 4 per fp32 state tensor per parameter) explicitly"
        )
    return MASTER_BYTES + 4 * state


def minispeed_state_bytes(
    num_params: int,
    world_size: int,
    stage: int,
    *,
    param_bytes: int,
    grad_bytes: int,
    state_bytes: int,
    persistent_params: int = 0,
    trainable_params: int | None = None,
) -> ModelStateBytes:
    """What minispeed's stage ``stage`` keeps per rank: `model_state_bytes` plus the two
    differences listed in this module's docstring.

    ``state_bytes`` = S, the inner optimizer's per-element state (K - 4); ``num_params`` counts the
    optimized parameters; ``persistent_params``: stage-3 elements kept whole on every rank;
    ``trainable_params``: elements with a master, gradient and state (default: all of them).
    """
    master_aliased = param_bytes == 4  # difference 1
    paper = model_state_bytes(
        num_params,
        world_size,
        stage,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=state_bytes + (0 if master_aliased else MASTER_BYTES),
        persistent_params=persistent_params if stage == 3 else 0,
        trainable_params=trainable_params,
    )
    params = paper.params
    if stage == 3:  # difference 2
        params += param_bytes * partition_numel(persistent_params, world_size)
    return ModelStateBytes(stage, world_size, params, paper.grads, paper.optimizer)


def forward_only_state_bytes(
    num_params: int, world_size: int, *, param_bytes: int, persistent_params: int = 0
) -> ModelStateBytes:
    """Stage 3 without an optimizer (``zero.shard(model, None, ...)``, ZeRO-Inference;
    stage3/forward_only.py), per rank: the parameter shards and nothing else,
    ``p·ceil((Ψ - Ψ_pers)/N) + p·Ψ_pers·(1 + 1/N)`` bytes, i.e. ``p·Ψ/N`` (``2Ψ/N`` for a
    16-bit model) without persistent parameters: no fp32 master (``4Ψ/N``), no gradient, no
    optimizer state. `minispeed_state_bytes` with nothing trainable."""
    return minispeed_state_bytes(
        num_params,
        world_size,
        3,
        param_bytes=param_bytes,
        grad_bytes=0,
        state_bytes=0,
        persistent_params=persistent_params,
        trainable_params=0,
    )


def hpz_secondary_bytes(
    numels: list[int] | tuple[int, ...],
    world_size: int,
    hpz_partition_size: int,
    *,
    param_bytes: int,
    persistence_threshold_numel: int,
) -> int:
    """ZeRO++ hpZ's secondary partition, per rank: ``Σ (N/k)·ceil(n/N)·p`` over the
    non-persistent parameters (k = ``hpz_partition_size``; ``≈ Ψ·p/k``, padding aside).

    Each rank keeps, besides its ``1/N`` primary shard, a ``1/k`` slice of every parameter so that
    backward gathers inside its node (stage3/zeropp.py). 0 when hpZ is off (k = 1).
    """
    if hpz_partition_size <= 1:
        return 0
    per = world_size // hpz_partition_size
    return sum(
        per * partition_numel(n, world_size) * param_bytes
        for n in numels
        if n > persistence_threshold_numel
    )
