"""minispeed.tensor_parallel: Megatron-style tensor parallelism for training, with autograd.

Reading order (see README.md):

1. `group` — the tensor-parallel group a layer splits over (always the caller's).
2. `mappings` — the conjugate communication functions (copy / reduce, gather / scatter, and
   the sequence-parallel all-gather / reduce-scatter), as autograd functions over `minispeed.comm`.
3. `sharding` — which slice of a weight each rank keeps, and gathering them back.
4. `layers` — `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`.
5. `cross_entropy` — the loss over vocabulary-split logits.
6. `costs` — bytes per call of each layer, the formulas the tests assert.
7. `styles`, `plan`, `plans` — `parallelize(model, plan, group)` and the ready plans;
   `auto` — `auto_plan(model)`, a plan read from a Hugging Face model's structure (AutoTP);
   `agreed` — a plan chosen and applied on every rank of a grid, agreed by all of them (the
   engine's tensor-parallel step).
8. `memory` — activation bytes per rank, with and without sequence parallelism.
9. `config` — `TensorParallelConfig`, DeepSpeed's `tensor_parallel` section (the grid's T).
10. `ulysses` — DeepSpeed-Ulysses sequence parallelism: `seq_all_to_all` (heads for sequence,
    differentiable), its unequal-chunk form `uneven_seq_all_to_all` with `head_shares`
    (DeepSpeed's uneven key/value heads), and `DistributedAttention` around any local attention.
11. `seeds` — the random streams per tensor-parallel rank (`seed_tensor_parallel`): the default
    generator alike on a group, a tracked state (`minispeed.core.rng`) apart.
12. `alst` — Ulysses for Hugging Face models (ALST): `register_ulysses_attention` (transformers'
    attention run over the sequence split), `SequenceShardLoader`, `sequence_parallel_mean`.
13. `tiled` — sequence tiling: `TiledMLP`, `TiledLogitsLoss`, `sequence_tiled_compute` (one
    tile's intermediates at a time; no communication).

```python
import minispeed.tensor_parallel as tp

tp.parallelize(model, tp.gpt_plan(model, sequence_parallel=True), group)
logits, _ = model(idx)                                   # (B, T, V/n) on each rank
loss = tp.vocab_parallel_cross_entropy(logits, targets, group)
```
"""

from minispeed.tensor_parallel.agreed import (
    agreed,
    apply_plan,
    parallelize_everywhere,
    ready_plan,
    rebind,
)
from minispeed.tensor_parallel.alst import (
    SequenceShardLoader,
    UlyssesAttention,
    register_ulysses_attention,
    sequence_parallel_mean,
    shard_batch,
    unregister_ulysses_attention,
)
from minispeed.tensor_parallel.auto import auto_plan, decoder_layers, kept_numel
from minispeed.tensor_parallel.config import TensorParallelConfig
from minispeed.tensor_parallel.costs import (
    Collective,
    column_collectives,
    cross_entropy_collectives,
    embedding_collectives,
    row_collectives,
)
from minispeed.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from minispeed.tensor_parallel.group import TensorGroup
from minispeed.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minispeed.tensor_parallel.mappings import (
    copy_to_parallel,
    gather_from_parallel,
    gather_from_sequence,
    reduce_from_parallel,
    reduce_scatter_to_sequence,
    scatter_to_parallel,
    scatter_to_sequence,
)
from minispeed.tensor_parallel.plan import Plan, check_divides, parallelize
from minispeed.tensor_parallel.plans import gpt2_plan, gpt_plan, llama_plan
from minispeed.tensor_parallel.seeds import (
    TENSOR_SEED_OFFSET,
    reseed_tensor_parallel,
    seed_tensor_parallel,
    tensor_seed,
)
from minispeed.tensor_parallel.sharding import (
    ShardSpec,
    shard,
    unshard,
    unshard_module,
    unshard_state_dict,
)
from minispeed.tensor_parallel.styles import (
    Column,
    HeadInput,
    HeadNorm,
    Heads,
    Row,
    ScatterSequence,
    SequenceShard,
    Vocab,
)
from minispeed.tensor_parallel.tiled import (
    SequenceTiledCompute,
    TiledLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)
from minispeed.tensor_parallel.ulysses import (
    DistributedAttention,
    head_shares,
    seq_all_to_all,
    seq_all_to_all_bytes,
    uneven_seq_all_to_all,
)

__all__ = [
    "TENSOR_SEED_OFFSET",
    "Collective",
    "Column",
    "ColumnParallelLinear",
    "DistributedAttention",
    "HeadInput",
    "HeadNorm",
    "Heads",
    "Plan",
    "Row",
    "RowParallelLinear",
    "ScatterSequence",
    "SequenceShard",
    "SequenceShardLoader",
    "SequenceTiledCompute",
    "ShardSpec",
    "TensorGroup",
    "TensorParallelConfig",
    "TiledLogitsLoss",
    "TiledMLP",
    "UlyssesAttention",
    "Vocab",
    "VocabParallelEmbedding",
    "agreed",
    "apply_plan",
    "auto_plan",
    "check_divides",
    "column_collectives",
    "copy_to_parallel",
    "cross_entropy_collectives",
    "decoder_layers",
    "embedding_collectives",
    "gather_from_parallel",
    "gather_from_sequence",
    "gpt2_plan",
    "gpt_plan",
    "head_shares",
    "kept_numel",
    "llama_plan",
    "parallelize",
    "parallelize_everywhere",
    "ready_plan",
    "rebind",
    "reduce_from_parallel",
    "reduce_scatter_to_sequence",
    "register_ulysses_attention",
    "reseed_tensor_parallel",
    "row_collectives",
    "scatter_to_parallel",
    "scatter_to_sequence",
    "seed_tensor_parallel",
    "seq_all_to_all",
    "seq_all_to_all_bytes",
    "sequence_parallel_mean",
    "sequence_tiled_compute",
    "shard",
    "shard_batch",
    "tensor_seed",
    "uneven_seq_all_to_all",
    "unregister_ulysses_attention",
    "unshard",
    "unshard_module",
    "unshard_state_dict",
    "vocab_parallel_cross_entropy",
]
