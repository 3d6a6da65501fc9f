"""TRL's trainers on DeepSpeed, kept as a reference (2 processes, CPU).

Written against TRL's, transformers' and PEFT's public API only, as a user fine-tuning with TRL
and a Hugging Face-style ds_config (every size `"auto"`): a tiny `LlamaForCausalLM` written once
with `save_pretrained` and loaded with `from_pretrained` (partitioned under ZeRO-3), a word-level
tokenizer built in memory (no download), and for each of ZeRO-2 and ZeRO-3:

- `SFTTrainer` on plain text (3 optimizer steps of 2 micro-batches);
- `SFTTrainer` with a LoRA adapter (`peft_config`): the base frozen, only the adapter trained,
  then `save_model()` writing the adapter alone (its tensors' sum recorded on rank 0);
- `DPOTrainer` on preference pairs with no reference model given: TRL copies the policy and
  prepares the copy with `deepspeed.initialize` and no optimizer, from the Trainer's ds_config
  *before* the Trainer fills its `"auto"` values, with sizes added as dotted top-level keys
  (`"zero_optimization.reduce_bucket_size"`), and at ZeRO-2 turned to stage 0. Its loss, reward
  margins and log-probabilities over 5 steps (the first updates at a warm-up learning rate of
  0, so rewards leave 0 at step 4);
- at ZeRO-3 only: `GRPOTrainer` with a reward function and a KL term (`beta`), so TRL samples
  completions with `generate` inside `GatheredParameters` of the whole model, stripping and
  restoring DeepSpeed's module hooks around it (`parameter_offload`), and prepares a reference
  model at ZeRO-3 without an optimizer; `RewardTrainer` on a `LlamaForSequenceClassification`
  loaded partitioned.

Recorded per optimizer step: what the trainer logs (loss, gradient norm, DPO's rewards and
log-probabilities, GRPO's reward, KL and completion length, the reward model's accuracy and
margin). The accelerate state is started as in `record_ds_trainer.py` (gloo on a
CPU-only host).

Recorded on DeepSpeed 0.19.8 (TRL 1.16, PEFT 0.21), 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_trl.py
```

which writes `tests/engine/fixtures/ds_trl.json`. `tests/engine/test_compat_clients.py` runs
this same file, unchanged, on minispeed (the `deepspeed` distribution) and compares.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.state import AcceleratorState, GradientState
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)
from trl import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_trl.json"
WORDS = [f"w{i}" for i in range(120)]
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
LLAMA = {
    "vocab_size": len(SPECIAL) + len(WORDS),
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}
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
# (stage, trainer, steps, learning rate)
RUNS = {
    f"{kind}-z{stage}": (stage, kind, steps, lr)
    for stage in (2, 3)
    for kind, steps, lr in (("sft", 3, 1e-3), ("sft_lora", 3, 1e-2), ("dpo", 5, 2e-2))
}
RUNS |= {"grpo-z3": (3, "grpo", 3, 1e-2), "reward-z3": (3, "reward", 3, 1e-2)}
LOGGED = (
    "loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen",  # DPO
    "reward", "kl", "completions/mean_length",  # GRPO
    "accuracy", "margin",  # the reward model
)  # fmt: skip


def tokenizer():
    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )  # fmt: skip


def counting(g, n):
    """n words counting from a random start by a random stride: a pattern a few steps learn."""
    start, stride = torch.randint(0, 120, (1,), generator=g), torch.randint(1, 4, (1,), generator=g)
    return " ".join(WORDS[(start.item() + stride.item() * k) % 120] for k in range(n))


def datasets():
    g = torch.Generator().manual_seed(3)
    text = Dataset.from_list([{"text": counting(g, 12)} for _ in range(32)])
    pairs = Dataset.from_list(
        [
            {"prompt": counting(g, 6), "chosen": " " + counting(g, 5), "rejected": " " + counting(g, 5)}
            for _ in range(32)
        ]
    )  # fmt: skip
    return text, pairs


def reward_words(completions, **_):
    """GRPO's reward: completions of a length ≡ 2 mod 3 and those naming `w5` score higher."""
    return [float(len(c.split()) % 3) + float("w5" in c.split()) for c in completions]


def one_run(name, init, scratch):
    stage, kind, steps, lr = RUNS[name]
    AcceleratorState._reset_state()  # a new trainer starts a new accelerate state
    GradientState._reset_state()
    text, pairs = datasets()
    common = dict(
        output_dir=str(scratch / name), deepspeed={**DS_CONFIG, "zero_optimization": {"stage": stage}},
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
        learning_rate=lr, warmup_steps=1, logging_steps=1, save_strategy="no", bf16=False,
        seed=7, report_to=[], disable_tqdm=True, accelerator_config={"use_configured_state": True},
    )  # fmt: skip
    if kind == "reward":  # a sequence-scoring head on the same body, trained on the pairs
        model = LlamaForSequenceClassification.from_pretrained(init, num_labels=1)
        model.config.pad_token_id = 0
        args = RewardConfig(max_length=16, **common)
        trainer = RewardTrainer(
            model=model, args=args, train_dataset=pairs, processing_class=tokenizer()
        )
    else:
        model = LlamaForCausalLM.from_pretrained(init)  # under ZeRO-3: built partitioned
    if kind == "grpo":  # sampling under ZeRO-3 (TRL gathers every parameter around generate)
        prompts = Dataset.from_list([{"prompt": p} for p in pairs["prompt"]])
        args = GRPOConfig(num_generations=4, max_completion_length=6, beta=0.04, **common)
        trainer = GRPOTrainer(
            model=model, reward_funcs=reward_words, args=args, train_dataset=prompts,
            processing_class=tokenizer(),
        )  # fmt: skip
    elif kind == "dpo":
        args = DPOConfig(max_length=16, beta=0.1, **common)
        trainer = DPOTrainer(
            model=model, args=args, train_dataset=pairs, processing_class=tokenizer()
        )
    elif kind.startswith("sft"):
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        trainer = SFTTrainer(
            model=model, args=SFTConfig(max_length=16, **common), train_dataset=text,
            processing_class=tokenizer(), peft_config=lora if kind == "sft_lora" else None,
        )  # fmt: skip
    trainer.train()
    out = {
        "steps": [
            {k: h[k] for k in LOGGED if k in h} for h in trainer.state.log_history if "loss" in h
        ]
    }
    if kind == "sft_lora":
        trainer.save_model(str(scratch / name / "adapter"))
        dist.barrier()
        if dist.get_rank() == 0:
            from safetensors.torch import load_file

            saved = load_file(str(scratch / name / "adapter" / "adapter_model.safetensors"))
            out["adapter_keys"] = len(saved)
            out["adapter_abs_sum"] = sum(t.double().abs().sum().item() for t in saved.values())
    return out


def main(scratch):
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # accelerate on a CPU-only host (record_ds_trainer.py)
    init = scratch / "init"
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(init)
    dist.barrier()
    return {name: one_run(name, init, scratch) for name in RUNS}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record

    scratch = Path(os.environ.get("TRAINER_SCRATCH", tempfile.gettempdir())) / "ds_trl"
    record(main(scratch), FIXTURE, scratch=scratch)
