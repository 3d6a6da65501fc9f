"""Seeds per tensor-parallel rank: the default generator alike on a group, a tracked state apart.

Megatron-LM's rule, which DeepSpeed's `model_parallel_cuda_manual_seed` keeps: from one
user seed ``s``, on tensor-parallel rank ``t``,

| stream | seed | same on | used for |
|---|---|---|---|
| the accelerator's generator | ``s`` | every rank | dropout on activations each rank holds whole |
| tracked ``"model-parallel-rng"`` | ``s + 2718 + t`` | data-parallel replicas of rank ``t`` | dropout on the rank's own slice, inside ``rng_tracker().fork()`` |

(2718 only keeps the two streams' seeds apart.) Activation checkpointing replays both
(`minispeed.core.rng`, Note [replaying every stream]). Cost: two generator seedings; the
tracker keeps one generator state (16 B per CUDA state, 5,056 B on the CPU).

```python
import minispeed.tensor_parallel as tp
from minispeed.core.rng import rng_tracker

tp.seed_tensor_parallel(1234, tp.TensorGroup.of(group).rank)
with rng_tracker().fork():
    h = dropout(h_local)                 # a different mask on each tensor-parallel rank
```
"""

from __future__ import annotations

from minispeed.core.rng import MODEL_PARALLEL_RNG, device_manual_seed, rng_tracker

__all__ = ["TENSOR_SEED_OFFSET", "reseed_tensor_parallel", "seed_tensor_parallel", "tensor_seed"]

TENSOR_SEED_OFFSET = 2718
"""Added to the user's seed (then the tensor-parallel rank) for the tracked state."""


def tensor_seed(seed: int, tensor_rank: int) -> int:
    """The tracked state's seed on tensor-parallel rank `tensor_rank`: ``seed + 2718 + rank``."""
    return seed + TENSOR_SEED_OFFSET + tensor_rank


def seed_tensor_parallel(seed: int, tensor_rank: int) -> None:
    """Seed the accelerator's generator with `seed` and make the tracker hold exactly
    ``"model-parallel-rng"`` seeded with `tensor_seed(seed, tensor_rank)` (earlier tracked
    states are dropped). Local: every rank calls it with its own tensor-parallel rank."""
    tracker = rng_tracker()
    tracker.reset()
    device_manual_seed(seed)
    tracker.add(MODEL_PARALLEL_RNG, tensor_seed(seed, tensor_rank))


def reseed_tensor_parallel(seed: int, tensor_rank: int) -> None:
    """Re-seed the tracked ``"model-parallel-rng"`` state only, with
    `tensor_seed(seed, tensor_rank)` (after a change of tensor-parallel layout: a resumed run
    re-seeds so each new rank draws its own masks); the accelerator's generator is untouched.
    Raises `RngStateError` when the state was never added (seed with `seed_tensor_parallel`)."""
    with rng_tracker().fork(MODEL_PARALLEL_RNG):
        device_manual_seed(tensor_seed(seed, tensor_rank))
