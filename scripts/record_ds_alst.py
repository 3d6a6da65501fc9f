"""Hugging Face's ALST (Ulysses sequence parallelism) on DeepSpeed, kept as a reference (2
processes, CPU).

Written against transformers', accelerate's and DeepSpeed's public API only, as the two ways a
user reaches `deepspeed.runtime.sequence_parallel.ulysses_sp`:

- `trainer-z2`, `trainer-z3`: transformers' `Trainer` with `TrainingArguments(parallelism_config=
  ParallelismConfig(sp_size=2, sp_backend="deepspeed", ...))` (accelerate registers the Ulysses
  attention with transformers, builds the sequence-parallel groups, hands DeepSpeed the `mpu`,
  wraps the data loader in `UlyssesSPDataLoaderAdapter`; the Trainer aggregates the two shards'
  losses): a tiny grouped-query `LlamaForCausalLM` (sdpa attention) loaded with
  `from_pretrained`, ZeRO-2 and ZeRO-3, 4 optimizer steps, per step the loss and gradient norm
  the Trainer logs, and `evaluate()`'s loss (each rank evaluating whole sequences: accelerate
  registers the attention with `disable_in_eval`);
- `direct-z3`: the loop of DeepSpeed's ALST tutorial, by hand: `register_with_transformers`,
  `deepspeed.initialize(..., mpu=mpu)`, `UlyssesSPDataLoaderAdapter` over a plain `DataLoader`,
  the model's own `loss_function` on `shift_labels`, the shards' losses weighted by their
  counted tokens through a differentiable all-gather; batches of two sequence lengths (16 and
  12 tokens) and labels masked with -100 over a prompt, so the shards count different tokens.
  Per step the loss and DeepSpeed's global gradient norm.

Both SP ranks compute the same loss at every step (one sequence shared by the two), and each of
those losses must equal the plain full-sequence loss of that batch on one process (the
minispeed test checks that against single-process PyTorch as well).

Recorded on DeepSpeed 0.19.8 (transformers 5.24, accelerate 1.15), 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_alst.py
```

which writes `tests/engine/fixtures/ds_alst.json`. `tests/engine/test_compat_alst.py` runs this
same file, unchanged, on minispeed (the `deepspeed` distribution) and compares.
"""

import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig
from deepspeed.runtime.sequence_parallel import parallel_state_sp
from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss,
    TiledMLP,
    UlyssesSPAttentionHF,
    UlyssesSPDataLoaderAdapter,
)
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_alst.json"
LLAMA = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query: one key/value head per SP rank
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
SEQ, STEPS, SP = 16, 4, 2
DS_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "steps_per_print": 1000,
}


SDPA, MLP_FORWARD = ALL_ATTENTION_FUNCTIONS["sdpa"], modeling_llama.LlamaMLP.forward


def fresh_sequence_parallel():
    """Undo the previous run's Ulysses set-up: DeepSpeed builds its sequence-parallel groups once
    per process (a second `register_with_transformers` asserts) and registers its attention over
    whatever "sdpa" holds (a second one would wrap the first), so several runs in one process
    release the groups and put transformers' sdpa back first. The only line a one-run script
    would not need."""
    parallel_state_sp._release_sequence_parallel_groups()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = SDPA
    modeling_llama.LlamaMLP.forward = MLP_FORWARD


def tiled_mlp_forward(self, x):
    """ALST's TiledMLP patched into LlamaMLP (DeepSpeed's documented example): the MLP computed
    over sequence tiles of about `hidden_size` tokens, the tile count agreed across ranks."""
    shards = torch.tensor(math.ceil(x.shape[-2] / 4), device=x.device)  # 4-token tiles
    dist.all_reduce(shards, op=dist.ReduceOp.MAX)

    def mlp(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
    return TiledMLP.apply(mlp, self, x, int(shards.item()), params)


def rows(n, seed, lengths=(SEQ,), prompt=0):
    """Counting sequences (a random start and stride) with their positions; the first `prompt`
    labels of every other row masked (-100), as an SFT prompt."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        start = torch.randint(0, LLAMA["vocab_size"], (1,), generator=g)
        stride = torch.randint(1, 4, (1,), generator=g)
        ids = (start + stride * torch.arange(length)) % LLAMA["vocab_size"]
        labels = ids.clone()
        if i % 2:
            labels[:prompt] = -100
        out.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(length)})
    return out


def one_trainer_run(stage, init, scratch):
    fresh_sequence_parallel()
    AcceleratorState._reset_state()  # a new trainer starts a new accelerate state
    GradientState._reset_state()
    parallelism = ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=SP,
        dp_replicate_size=1,
        sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"
        ),
    )
    args = TrainingArguments(
        output_dir=str(scratch / f"trainer-z{stage}"),
        deepspeed={**DS_CONFIG, "zero_optimization": {"stage": stage}},
        parallelism_config=parallelism,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        learning_rate=1e-2,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        seed=7,
        report_to=[],
        disable_tqdm=True,
        accelerator_config={"use_configured_state": True},
    )
    model = LlamaForCausalLM.from_pretrained(init, attn_implementation="sdpa")
    trainer = Trainer(model=model, args=args, train_dataset=rows(16, 1), eval_dataset=rows(4, 3))
    trainer.train()
    steps = [
        {"loss": h["loss"], "grad_norm": h["grad_norm"]}
        for h in trainer.state.log_history
        if "loss" in h
    ]
    # evaluation runs without sequence parallelism (accelerate registers with disable_in_eval)
    return {"steps": steps, "eval_loss": trainer.evaluate()["eval_loss"]}


def summed_loss(model, x, y):
    """The summed token losses of one tile of hidden states `x` and shifted labels `y`."""
    logits = model.lm_head(x).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")


def direct_run(init, tiled):
    """DeepSpeed's ALST tutorial loop: Ulysses attention, the data-loader adapter, and the
    shards' losses weighted by their tokens across the SP group. `tiled`: TiledMLP in every
    layer and the loss by TiledFusedLogitsLoss (never the whole logits tensor), as ALST adds."""
    fresh_sequence_parallel()
    if tiled:
        modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    model = LlamaForCausalLM.from_pretrained(init, attn_implementation="sdpa")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=SP,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3},
        "steps_per_print": 1000,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, mpu=mpu
    )
    sp_group = mpu.get_sequence_parallel_group()
    sp_rank = mpu.get_sequence_parallel_rank()
    sp_world = mpu.get_sequence_parallel_world_size()
    # each rank reads its own batches; the adapter shares each one across the SP group (the
    # two ranks' i-th batches of one length: DeepSpeed's adapter all-gathers them as they are,
    # which gloo refuses for unequal lengths)
    mine = rows(8, 2, lengths=(SEQ, SEQ, 12, 12), prompt=5)[
        dist.get_rank() :: dist.get_world_size()
    ]
    loader = DataLoader(mine, batch_size=1)
    loader = UlyssesSPDataLoaderAdapter(
        loader, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world, device=engine.device
    )
    steps = []
    for batch in loader:
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        shift_labels = batch["shift_labels"]
        if tiled:  # the body's hidden states, then the head and loss over 3 tiles
            hidden = model.model(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"]
            ).last_hidden_state
            summed = TiledFusedLogitsLoss.apply(
                summed_loss, model, hidden, shift_labels, None, 3, [model.lm_head.weight], "sum"
            )
            loss = summed / (shift_labels != -100).sum().clamp(min=1)
        else:
            outputs = engine(**batch)
            loss = model.loss_function(
                logits=outputs.logits,
                labels=None,
                shift_labels=shift_labels,
                vocab_size=model.config.vocab_size,
            )
        losses = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        tokens = (shift_labels != -100).view(-1).sum()
        counted = torch.distributed.nn.functional.all_gather(tokens, group=sp_group)
        total = sum(losses[r] * counted[r] for r in range(sp_world))
        loss = total / max(sum(counted), 1)
        engine.backward(loss)
        engine.step()
        steps.append(
            {
                "loss": loss.item(),
                "grad_norm": float(engine.get_global_grad_norm()),
                "length": int(shift_labels.shape[1]) * sp_world,
            }
        )
    return {"steps": steps}


def main(scratch):
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # accelerate on a CPU-only host (record_ds_trainer.py)
    init = scratch / "init"
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(init)
    dist.barrier()
    out = {f"trainer-z{stage}": one_trainer_run(stage, init, scratch) for stage in (2, 3)}
    out["direct-z3"] = direct_run(init, tiled=False)
    out["direct-tiled-z3"] = direct_run(init, tiled=True)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record

    scratch = Path(os.environ.get("TRAINER_SCRATCH", tempfile.gettempdir())) / "ds_alst"
    record(main(scratch), FIXTURE, scratch=scratch)
