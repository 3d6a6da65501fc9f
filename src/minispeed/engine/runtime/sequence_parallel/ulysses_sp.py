"""`deepspeed.runtime.sequence_parallel.ulysses_sp`: ALST's pieces under DeepSpeed's names, the
module accelerate's `ParallelismConfig(sp_backend="deepspeed", sp_size=N)` and transformers'
Trainer import, over `minispeed.tensor_parallel.alst` and `.tiled`.

```python
from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter)
mpu = UlyssesSPAttentionHF.register_with_transformers(
    model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=2,
    micro_batch_size=1, seq_length_is_variable=True)      # groups built, attention registered
engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=mpu)
loader = UlyssesSPDataLoaderAdapter(loader, sp_rank=mpu.get_sequence_parallel_rank(),
    sp_group=mpu.get_sequence_parallel_group(),
    sp_world_size=mpu.get_sequence_parallel_world_size(), device=engine.device)
```

The same arguments and meanings as DeepSpeed 0.19.8, with these differences:

- `register_with_transformers` registered again (a second run in one process) wraps
  transformers' own attention, not the previous wrapper (DeepSpeed's would wrap its wrapper and
  exchange twice); the groups must still be released between runs
  (`parallel_state_sp._release_sequence_parallel_groups()`), as in DeepSpeed.
- `UlyssesSPDataLoaderAdapter` accepts SP ranks whose batches differ in length (DeepSpeed
  all-gathers them as they are, which gloo refuses), makes `position_ids` (0..T-1 per row) when a
  batch has none (DeepSpeed raises), and fails on every rank when one rank's loader ends first.
- `TiledFusedLogitsLoss` recomputes each tile in backward: its weight gradients are exact for any
  incoming gradient (DeepSpeed's, computed inside forward for an incoming gradient of 1, are not
  when the loss is then divided by a token count or weighted across the SP group), at the cost
  of one more forward of the head; `TiledMLP` and the tiled compute hand each weight's gradient
  over once, summed over the tiles (so `compute_params` only names the weights; `ds_grad_is_ready`
  is not used).
- The fixed-length shape checks (`seq_length_is_variable=False`) are one: `seq_length` divides
  by the SP size. Flex attention's block mask is not rebuilt for the whole sequence (CPU
  training here is sdpa); `skip_all_but_last_attention_debug_mode` is not provided.
"""

from __future__ import annotations

from typing import Any

from minispeed.engine.runtime.sequence_parallel import parallel_state_sp
from minispeed.tensor_parallel.alst import (
    SequenceShardLoader,
    UlyssesAttention,
    register_ulysses_attention,
)
from minispeed.tensor_parallel.tiled import SequenceTiledCompute, TiledMLP, sequence_tiled_compute
from minispeed.tensor_parallel.tiled import TiledLogitsLoss as TiledFusedLogitsLoss

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "sequence_tiled_compute",
]


class UlyssesSPAttentionHF(UlyssesAttention):
    """DeepSpeed's Ulysses attention for transformers: `UlyssesAttention` with DeepSpeed's
    constructor (the batch size, head size, layer count and fixed lengths are accepted; the
    shapes are read from each call)."""

    def __init__(
        self,
        attn: Any,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Any,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__(
            attn, process_group, num_heads=attn_head_count, num_kv_heads=kv_head_count,
            disable_in_eval=disable_in_eval,
        )  # fmt: skip
        self.batch_size, self.attn_head_size = batch_size, attn_head_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length

    forward = UlyssesAttention.__call__

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> Any:
        """Build the sequence-parallel groups (`parallel_state_sp`), make transformers'
        `core_attn_implementation` run over them, and return `parallel_state_sp` (the `mpu` for
        `initialize`); `None` when `sequence_parallel_size` is 1. `model_name_or_path`: a loaded
        model (whose `attn_implementation` must be `core_attn_implementation`) or a name for
        `AutoConfig`."""
        if sequence_parallel_size == 1:
            return None
        seq_length = seq_length if seq_length is not None else max_length
        if not seq_length_is_variable:
            if seq_length is None:
                raise ValueError(
                    "seq_length_is_variable=False needs seq_length (every batch's length)"
                )
            if seq_length % sequence_parallel_size:
                raise ValueError(
                    f"seq_length {seq_length} is not divisible by the sequence-parallel size "
                    f"{sequence_parallel_size}: pad batches to a multiple of it"
                )
        if hasattr(model_name_or_path, "config"):
            config = model_name_or_path.config
            loaded = getattr(config, "_attn_implementation", None)
            if loaded is not None and loaded != core_attn_implementation:
                raise ValueError(
                    f"core_attn_implementation={core_attn_implementation!r} does not match the "
                    f"model's attn_implementation {loaded!r}: load the model with the attention "
                    "you register, so the registered one is the one it calls"
                )
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_name_or_path)
        parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        register_ulysses_attention(
            core_attn_implementation, parallel_state_sp.get_sequence_parallel_group(), config,
            disable_in_eval=disable_in_eval,
        )  # fmt: skip
        return parallel_state_sp


class UlyssesSPDataLoaderAdapter(SequenceShardLoader):
    """DeepSpeed's data-loader adapter: `SequenceShardLoader(dl, sp_group, device=device)`;
    `sp_rank` and `sp_world_size` must be this rank's place in `sp_group`."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any):
        super().__init__(dl, sp_group, device=device)
        if (sp_rank, sp_world_size) != (self.rank, self.size):
            raise ValueError(
                f"sp_rank={sp_rank}, sp_world_size={sp_world_size} do not describe this rank in "
                f"sp_group (rank {self.rank} of {self.size}): pass the group's own "
                "(mpu.get_sequence_parallel_rank(), mpu.get_sequence_parallel_world_size())"
            )
