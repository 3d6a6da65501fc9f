"""Three more Hugging Face model families through the Trainer at ZeRO-3, kept as a reference.

Written against transformers' public API only, as a user fine-tuning with `--deepspeed`: each
model is written once with `save_pretrained` (random weights from a fixed seed) and loaded with
`from_pretrained` after the `TrainingArguments`, so ZeRO-3 builds it partitioned
(`HfDeepSpeedConfig`, `zero.Init`) and transformers loads the checkpoint into the shards:

- `T5ForConditionalGeneration`: encoder-decoder, the token embedding shared by encoder, decoder
  and head (one parameter used three times per step), grown by `resize_token_embeddings` after
  loading, as when a tokenizer gains tokens (the new rows drawn around the old rows' mean,
  inside `zero.GatheredParameters`); trained by the `Seq2SeqTrainer`, whose `predict` with
  `predict_with_generate` runs `generate` (beam search, 2 beams) under ZeRO-3, the encoder
  called alone;
- `BertForMaskedLM`: masked-LM head whose decoder weight is tied to the word embedding;
- `MixtralForCausalLM`: top-2 mixture of experts whose experts are fused 3-D parameters
  (transformers 5 loads them group by group, a module's parameters in separate state dicts),
  with the router's auxiliary loss.

Per family: the loss the Trainer logs at each of 4 optimizer steps and `evaluate()`'s loss (for
T5 also the generated tokens of `predict`).

Then accelerate's own loop on a tied-embedding `Qwen2ForCausalLM` at ZeRO-3 (`DummyOptim`, 3
steps), saved as transformers' `*_no_trainer.py` examples save, on every rank:
`accelerator.unwrap_model(model).save_pretrained(out, is_main_process=...,
save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))` (rank 0 gets the
gathered state dict, the other ranks `None`, so `save_pretrained` inspects their own
`state_dict()` for tied weights before deciding not to write); the saved model is reloaded with
`from_pretrained` on rank 0 and evaluated. The
accelerate state is started as in `record_ds_trainer.py` (gloo on a CPU-only host).

Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_hf_families.py
```

which writes `tests/engine/fixtures/ds_hf_families.json`. `tests/engine/test_compat_clients.py`
runs this same file, unchanged, on minispeed (the `deepspeed` distribution) and compares.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import transformers as hf
from accelerate import PartialState
from accelerate.state import AcceleratorState, GradientState

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_hf_families.json"
VOCAB, SEQ, TARGET = 96, 12, 6
FAMILIES = {
    "t5": (
        hf.T5ForConditionalGeneration,
        lambda: hf.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
        ),
    ),
    "bert": (
        hf.BertForMaskedLM,
        lambda: hf.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            max_position_embeddings=SEQ,
        ),
    ),
    "mixtral": (
        hf.MixtralForCausalLM,
        lambda: hf.MixtralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=SEQ, router_aux_loss_coef=0.01,
            output_router_logits=True,
        ),
    ),
}  # fmt: skip
DS_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 1000,
}


def rows(family, n, seed):
    """Random tokens: a T5 target of its own, BERT labels on every third token (MLM)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (SEQ,), generator=g)
        if family == "t5":
            out.append(
                {"input_ids": ids, "labels": torch.randint(1, VOCAB, (TARGET,), generator=g)}
            )
        elif family == "bert":
            labels = torch.full_like(ids, -100)
            labels[::3] = ids[::3]
            out.append({"input_ids": ids, "labels": labels})
        else:
            out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def one_family(family, scratch):
    cls, config = FAMILIES[family]
    init = scratch / family
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        cls(config()).save_pretrained(init)
    dist.barrier()
    AcceleratorState._reset_state()
    GradientState._reset_state()
    seq2seq = family == "t5"
    generation = {"predict_with_generate": True, "generation_max_length": 8} if seq2seq else {}
    if seq2seq:
        generation["generation_num_beams"] = 2
    arguments = hf.Seq2SeqTrainingArguments if seq2seq else hf.TrainingArguments
    args = arguments(
        output_dir=str(scratch / f"{family}-out"),
        deepspeed=DS_CONFIG,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        max_steps=4,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        report_to=[],
        disable_tqdm=True,
        accelerator_config={"use_configured_state": True},
        **generation,
    )
    model = cls.from_pretrained(init)  # under ZeRO-3: built partitioned, loaded into the shards
    if family == "t5":
        model.resize_token_embeddings(VOCAB + 8)
    trainer = (hf.Seq2SeqTrainer if seq2seq else hf.Trainer)(
        model=model, args=args, train_dataset=rows(family, 16, 1), eval_dataset=rows(family, 8, 2)
    )
    trainer.train()
    result = {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": trainer.evaluate()["eval_loss"],
    }
    if seq2seq:
        result["generated"] = trainer.predict(rows(family, 5, 3)).predictions.tolist()
    return result


def accelerate_no_trainer(scratch):
    """accelerate's loop at ZeRO-3 and the examples' save on every rank (module docstring)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state()
    GradientState._reset_state()
    config = {**DS_CONFIG, "train_micro_batch_size_per_gpu": 2, "train_batch_size": 4,
              "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}  # fmt: skip
    config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    config["zero_optimization"] = {**config["zero_optimization"],
                                   "stage3_gather_16bit_weights_on_model_save": True}  # fmt: skip
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    torch.manual_seed(0)
    model = hf.Qwen2ForCausalLM(
        hf.Qwen2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            tie_word_embeddings=True,
        )
    )  # fmt: skip
    model, optimizer = accelerator.prepare(model, DummyOptim(model.parameters()))
    g = torch.Generator().manual_seed(accelerator.process_index)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    out = scratch / "qwen2-saved"
    accelerator.unwrap_model(model).save_pretrained(
        out,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
        state_dict=accelerator.get_state_dict(model),
    )
    accelerator.wait_for_everyone()
    saved_loss = None
    if accelerator.is_main_process:
        unset_hf_deepspeed_config()  # a plain model: not built under zero.Init
        reloaded = hf.Qwen2ForCausalLM.from_pretrained(out).eval()
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            saved_loss = reloaded(input_ids=ids, labels=ids).loss.item()
    accelerator.wait_for_everyone()
    return {"losses": losses, "saved_model_loss": saved_loss}


def main(scratch):
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # accelerate on a CPU-only host (record_ds_trainer.py)
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    runs = {family: one_family(family, scratch) for family in FAMILIES}
    runs["qwen2_accelerate"] = accelerate_no_trainer(scratch)
    return runs


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record

    scratch = Path(os.environ.get("TRAINER_SCRATCH", tempfile.gettempdir())) / "ds_hf_families"
    record(main(scratch), FIXTURE, scratch=scratch)
