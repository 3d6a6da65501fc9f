"""More of what Trainer and accelerate users run on DeepSpeed, kept as a reference (2 processes, CPU).

Written against transformers' and accelerate's public API only, each case a use the other
client recorders (`record_ds_trainer.py`, `record_ds_hf_families.py`, `record_ds_trl.py`,
`record_ds_accelerate.py`) do not make:

- `gc_z3_reentrant`, `gc_z3`: the Trainer at ZeRO-3 with `gradient_checkpointing=True`, with
  `gradient_checkpointing_kwargs={"use_reentrant": True}` (the forward recomputed under
  `torch.utils.checkpoint`'s autograd function, where the stage-3 hooks see the layer twice)
  and with transformers 5's default (non-reentrant);
- `gc_z2_gas2`: the same at ZeRO-2 with 2 micro-batches per step;
- `compile_z2`: the Trainer with `torch_compile=True` at ZeRO-2 (accelerate calls
  `engine.compile`), with the `aot_eager` backend: forward and backward traced by AOTAutograd,
  no code generated (inductor gives the same numbers, in minutes on this CPU);
- `compile_z3`: the same at ZeRO-3, where the parameter hooks run around the compiled graphs
  (each gathers and releases the module's parameters eagerly);
- `eval_only_z3`: a Trainer that never trains (`evaluate()` and `predict()` only), so
  transformers' `deepspeed_init(inference=True)` drops the optimizer and scheduler from the
  ds_config; the model loaded partitioned by `from_pretrained`;
- `albert_z3`: ALBERT, whose one transformer layer's weights serve every layer (the same
  parameters fetched and released several times in one forward and one backward);
- `bart_z3`: BART through the `Seq2SeqTrainer`, evaluated with `predict_with_generate` (greedy
  `generate` under ZeRO-3 inside `evaluate()`);
- `fp16_z2`, `fp16_z3`: the Trainer in fp16 (`"fp16": {"enabled": "auto"}`, dynamic loss
  scaling) whose first loss scale overflows the gradients: the skipped step's logged gradient
  norm, accelerate's `optimizer_step_was_skipped` after each step, the learning rate (the
  scheduler does not step on a skipped step), the engine's `global_steps` and `skipped_steps`;
- `trainer_fp16_auto_cast_z2`: the Trainer with `fp16=True` and a ds_config without an `fp16`
  section, which accelerate then writes as `{"enabled": true, "auto_cast": true}`;
- `best_model_z3`: the Trainer evaluating and saving every 2 steps with
  `load_best_model_at_end=True` (the best checkpoint loaded back into the engine at the end);
- `save_model_z3`: accelerate's `save_model` at ZeRO-3, the saved safetensors' keys and sum;
- `odd_params_z2`, `odd_params_z3`: accelerate's loop on a model that calls one `Linear` twice
  per forward, skips a branch on every other step (its parameters get no gradient then), and
  reads a sibling module's weight directly (`F.linear(x, self.embed.weight)`: an output head tied
  by hand, a parameter used outside its module's forward), and the same steps in single-process
  PyTorch;
- `accumulate_generate_z3`: accelerate's loop with `gradient_accumulation_steps` on the
  `Accelerator` and `accumulate`, then `unwrap_model(model).generate(..., synced_gpus=True)`
  with a prompt and an output length per rank;
- `save_no_gather_z3`: the Trainer's `save_model()` at ZeRO-3 without
  `stage3_gather_16bit_weights_on_model_save` (a DeepSpeed checkpoint is written instead), the
  weights recovered by `zero_to_fp32` into a plain model and evaluated;
- `plugin_fp16_z1`, `plugin_fp16_z3`: the `accelerate config` path, a `DeepSpeedPlugin` built
  from keyword arguments (no json) with `Accelerator(mixed_precision="fp16")`, for which
  accelerate writes `"fp16": {"enabled": true, "auto_cast": true}`; the script's own
  `torch.optim.AdamW` and `LambdaLR`, and a model called with one fp32 positional tensor, which
  `auto_cast` casts to fp16 (the loss, gradient norm and learning rate per micro-step, and the
  trained weights' absolute sums);
- `two_models`: accelerate with two DeepSpeed plugins (`deepspeed_plugins={"student": ...,
  "teacher": ...}`): a teacher at ZeRO-3 without an optimizer, prepared after
  `select_deepspeed_plugin("teacher")`, distilled into a student at ZeRO-2.

Per case the loss (and gradient norm) logged at each optimizer step, evaluation losses, and
what the case produces (generated tokens, predictions). DeepSpeed's CPU accelerator refuses fp16
on this host; `main` says it is supported (its note).

The accelerate state is started with `backend="gloo"` first (a CPU-only host: see
`record_ds_trainer.py`). Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_hf_more.py
```

which writes `tests/engine/fixtures/ds_hf_more.json`. `tests/engine/test_compat_clients.py` runs
this same file, unchanged, on minispeed (the `deepspeed` distribution) and compares.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DeepSpeedPlugin, DummyOptim
from deepspeed.accelerator import get_accelerator
from torch import nn

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_hf_more.json"
VOCAB, SEQ, TARGET, STEPS = 64, 12, 6, 3
LLAMA = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
)  # fmt: skip
ALBERT = dict(
    vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=3,
    num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0, max_position_embeddings=SEQ,
)  # fmt: skip
BART = dict(
    vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0,
    attention_dropout=0.0, max_position_embeddings=SEQ + 4, pad_token_id=1, bos_token_id=0,
    eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
)  # fmt: skip


# fp16 whose first loss scale (2^18) overflows the gradients: the first steps are skipped, the
# scale halved each time (hysteresis 1), until it fits.
FP16 = {"fp16": {"enabled": "auto", "initial_scale_power": 18, "hysteresis": 1}}


def ds_config(stage):
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
            },
        },
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }


def rows(kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        if kind == "seq2seq":
            out.append(
                {"input_ids": ids, "labels": torch.randint(3, VOCAB, (TARGET,), generator=g)}
            )
        elif kind == "mlm":
            labels = torch.full_like(ids, -100)
            labels[::3] = ids[::3]
            out.append({"input_ids": ids, "labels": labels})
        else:
            out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def saved(cls, config, scratch, name):
    """A model written once with random weights from a fixed seed, to load with from_pretrained."""
    init = scratch / name
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        cls(config).save_pretrained(init)
    dist.barrier()
    return init


def fresh_state():
    AcceleratorState._reset_state()
    GradientState._reset_state()


class SkippedSteps(hf.TrainerCallback):
    """accelerate's `optimizer_step_was_skipped` after each optimizer step of `trainer`."""

    def __init__(self):
        self.trainer, self.skipped = None, []

    def on_step_end(self, args, state, control, **kwargs):
        self.skipped.append(self.trainer.accelerator.optimizer_step_was_skipped)


def trainer_case(
    scratch, name, cls, config, kind, stage, train=True, ds=None, evals=False, save_to=None,
    **extra,
):  # fmt: skip
    init = saved(cls, config, scratch, name)
    fresh_state()
    seq2seq = kind == "seq2seq"
    arguments = hf.Seq2SeqTrainingArguments if seq2seq else hf.TrainingArguments
    settings = dict(
        output_dir=str(scratch / f"{name}-out"),
        deepspeed={**ds_config(stage), **(ds or {})},
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        report_to=[],
        disable_tqdm=True,
        accelerator_config={"use_configured_state": True},
    )
    args = arguments(**{**settings, **extra})
    model = cls.from_pretrained(init)  # under ZeRO-3: built partitioned, loaded into the shards
    skipped = SkippedSteps()
    trainer = (hf.Seq2SeqTrainer if seq2seq else hf.Trainer)(
        model=model, args=args, train_dataset=rows(kind, 24, 1), eval_dataset=rows(kind, 8, 2),
        callbacks=[skipped],
    )  # fmt: skip
    skipped.trainer = trainer
    result = {}
    if train:
        trainer.train()
        result["skipped"] = skipped.skipped
        engine = trainer.model_wrapped
        result["engine_steps"] = [engine.global_steps, engine.skipped_steps]
        result["compiled"] = engine.is_compiled
        result["steps"] = [
            {"loss": h["loss"], "grad_norm": h.get("grad_norm"), "lr": h["learning_rate"]}
            for h in trainer.state.log_history
            if "loss" in h
        ]
    if evals:  # evaluations during training, and which checkpoint was loaded at the end
        result["evals"] = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        result["best"] = Path(trainer.state.best_model_checkpoint).name
    result["eval_loss"] = trainer.evaluate()["eval_loss"]
    if save_to is not None:
        trainer.save_model(str(save_to))
    if seq2seq:
        result["generated"] = trainer.predict(rows(kind, 4, 3)).predictions.tolist()
    elif not train:
        predicted = trainer.predict(rows(kind, 4, 3))
        logits = torch.as_tensor(predicted.predictions)
        result["predict_loss"] = predicted.metrics["test_loss"]
        result["predict_argmax"] = logits.argmax(-1).tolist()
        result["predict_logit_sum"] = logits.double().sum().item()
    return result


class OddParams(nn.Module):
    """One Linear called twice per forward, a branch skipped on every other call, and a head that
    reads the embedding's weight directly."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.twice = nn.Linear(16, 16)
        self.branch = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, ids):
        self.calls += 1
        h = self.embed(ids)
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        if self.calls % 2 == 1:
            h = h + self.branch(h)
        return F.linear(h, self.embed.weight)  # the embedding's weight as the output head


def loop_config(stage):
    """accelerate's own loop: the optimizer from the config (`DummyOptim`), clipped to 1."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }


def loop_step(accelerator, model, optimizer, loss):
    """One step of accelerate's loop; the loss and the norm it reports."""
    accelerator.backward(loss)
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return {"loss": loss.item(), "grad_norm": float(norm)}


def odd_params_case(stage):
    fresh_state()
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=loop_config(stage)))
    torch.manual_seed(0)
    model = OddParams()
    model, optimizer = accelerator.prepare(model, DummyOptim(model.parameters()))
    g = torch.Generator().manual_seed(accelerator.process_index)
    steps = []
    for _ in range(4):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        steps.append(loop_step(accelerator, model, optimizer, loss))
    return {"steps": steps, "pytorch": odd_params_pytorch()[accelerator.process_index]}


def odd_params_pytorch():
    """`odd_params_case` as single-process PyTorch: both ranks' batches, their gradients
    averaged, clipped to 1, torch's AdamW; per rank, per step, its loss and the norm."""
    torch.manual_seed(0)
    model = OddParams()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gens = [torch.Generator().manual_seed(rank) for rank in range(2)]
    per_rank = [[], []]
    for _ in range(4):
        calls, losses = model.calls, []
        for g in gens:
            model.calls = calls  # both ranks' forward is the same call of the step
            ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
            logits = model(ids[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            (loss / 2).backward()
            losses.append(loss.item())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        optimizer.step()
        optimizer.zero_grad()
        for rank, loss in enumerate(losses):
            per_rank[rank].append({"loss": loss, "grad_norm": norm})
    return per_rank


def save_model_case(scratch):
    """accelerate's `save_model` at ZeRO-3 (the 16-bit weights gathered to rank 0, written as
    safetensors): the keys and the sum of the saved tensors."""
    from safetensors.torch import load_file

    fresh_state()
    config = loop_config(3)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    torch.manual_seed(0)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(**LLAMA))
    model, optimizer = accelerator.prepare(model, DummyOptim(model.parameters()))
    g = torch.Generator().manual_seed(accelerator.process_index)
    steps = []
    for _ in range(2):
        ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
        steps.append(
            loop_step(accelerator, model, optimizer, model(input_ids=ids, labels=ids).loss)
        )
    accelerator.save_model(model, str(scratch / "saved"))
    accelerator.wait_for_everyone()
    result = {"steps": steps, "saved_keys": None, "saved_abs_sum": None}
    if accelerator.is_main_process:
        saved = load_file(str(scratch / "saved" / "model.safetensors"))
        result["saved_keys"] = sorted(saved)
        result["saved_abs_sum"] = sum(t.double().abs().sum().item() for t in saved.values())
    accelerator.wait_for_everyone()
    return result


def accumulate_generate_case():
    """accelerate's loop at ZeRO-3 with the accumulation set on the `Accelerator` (the config's
    `"auto"` filled from it) and `accumulate`, then the no_trainer examples' generation:
    `unwrap_model(model).generate(..., synced_gpus=True)`, each rank a prompt and an output
    length of its own (the rank that finishes first keeps stepping for the other)."""
    fresh_state()
    config = {**loop_config(3), "gradient_accumulation_steps": "auto"}
    accelerator = Accelerator(
        gradient_accumulation_steps=2, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config)
    )
    torch.manual_seed(0)
    model = hf.LlamaForCausalLM(hf.LlamaConfig(**LLAMA))
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randint(3, VOCAB, (16, SEQ), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, DummyOptim(model.parameters()), loader)
    steps = []
    for (ids,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
                steps.append({"loss": loss.item(), "grad_norm": float(norm)})
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    rank = accelerator.process_index
    prompt = torch.randint(3, VOCAB, (1, 3 + rank), generator=torch.Generator().manual_seed(rank))
    out = accelerator.unwrap_model(model).generate(
        prompt, max_new_tokens=4 + 2 * rank, do_sample=False, synced_gpus=True
    )
    return {"steps": steps, "generated": out.tolist()}


def plugin_fp16_case(stage):
    """A `DeepSpeedPlugin` from keyword arguments with `mixed_precision="fp16"` (accelerate adds
    `fp16.auto_cast: true`), a torch optimizer and scheduler, an fp32 positional input."""
    fresh_state()
    # Under `accelerate launch --config_file` (the tests' launcher) the launcher's DeepSpeed
    # settings are in the environment and would fill the plugin: this case is the plugin built
    # from its keyword arguments alone, as a plain torchrun launch builds it.
    launched = {
        k: os.environ.pop(k)
        for k in list(os.environ)
        if k.startswith("ACCELERATE_DEEPSPEED_") or k == "ACCELERATE_CONFIG_DS_FIELDS"
    }
    try:
        plugin = DeepSpeedPlugin(
            zero_stage=stage, gradient_accumulation_steps=2, gradient_clipping=1.0,
            zero3_init_flag=False, zero3_save_16bit_model=True,
        )  # fmt: skip
        accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision="fp16")
    finally:
        os.environ.update(launched)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(),
        nn.Linear(32, 1),
    )  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    steps = []
    for inputs, target in loader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(inputs).float(), target)  # inputs: fp32, cast by auto_cast
            accelerator.backward(loss)
            step = {"loss": loss.item(), "lr": scheduler.get_last_lr()[0]}
            if accelerator.sync_gradients:
                step["grad_norm"] = float(accelerator.clip_grad_norm_(model.parameters(), 1.0))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            steps.append(step)
    state = accelerator.get_state_dict(model)  # rank 0's; None elsewhere at ZeRO-3
    sums = None if state is None else {k: v.float().abs().sum().item() for k, v in state.items()}
    return {"steps": steps, "weight_abs_sums": sums}


def save_without_gather_case(scratch):
    """The Trainer's `save_model()` at ZeRO-3 without `stage3_gather_16bit_weights_on_model_save`:
    transformers saves a DeepSpeed checkpoint instead, and the weights come back with
    `zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint` into a plain model (rank 0)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    result = trainer_case(
        scratch, "no_gather_z3", hf.LlamaForCausalLM, hf.LlamaConfig(**LLAMA), "clm", 3,
        ds={"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}},
        save_to=scratch / "no_gather_saved",
    )  # fmt: skip
    unset_hf_deepspeed_config()  # a plain model next: not built under zero.Init
    result["saved_files"], result["reloaded_eval_loss"] = None, None
    if dist.get_rank() == 0:
        saved = scratch / "no_gather_saved"
        result["saved_files"] = sorted(os.listdir(saved))
        model = hf.LlamaForCausalLM(hf.LlamaConfig(**LLAMA))
        model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(saved)))
        batch = torch.stack([r["input_ids"] for r in rows("clm", 8, 2)])
        with torch.no_grad():
            result["reloaded_eval_loss"] = model.eval()(input_ids=batch, labels=batch).loss.item()
    dist.barrier()
    return result


def two_models_case():
    """Distillation with a ZeRO-3 teacher (no optimizer) and a ZeRO-2 student, one Accelerator."""
    fresh_state()
    teacher_config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    plugins = {
        "student": DeepSpeedPlugin(hf_ds_config=loop_config(2)),
        "teacher": DeepSpeedPlugin(hf_ds_config=teacher_config),
    }
    accelerator = Accelerator(deepspeed_plugins=plugins)
    torch.manual_seed(0)
    student = hf.LlamaForCausalLM(hf.LlamaConfig(**{**LLAMA, "num_hidden_layers": 1}))
    teacher = hf.LlamaForCausalLM(hf.LlamaConfig(**LLAMA))
    student, optimizer = accelerator.prepare(student, DummyOptim(student.parameters()))
    accelerator.state.select_deepspeed_plugin("teacher")
    teacher = accelerator.prepare(teacher)
    teacher.eval()
    accelerator.state.select_deepspeed_plugin("student")
    g = torch.Generator().manual_seed(accelerator.process_index)
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(3, VOCAB, (2, SEQ), generator=g)
        with torch.no_grad():
            target = teacher(input_ids=ids).logits.softmax(-1)
        logits = student(input_ids=ids).logits
        loss = F.kl_div(logits.log_softmax(-1), target, reduction="batchmean")
        steps.append(loop_step(accelerator, student, optimizer, loss))
    return {"steps": steps}


def cases(scratch):
    llama = (hf.LlamaForCausalLM, hf.LlamaConfig(**LLAMA), "clm")
    return {
        "gc_z3_reentrant": lambda: trainer_case(
            scratch, "gc_z3_reentrant", *llama, 3, gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": True},
        ),
        "gc_z3": lambda: trainer_case(scratch, "gc_z3", *llama, 3, gradient_checkpointing=True),
        "gc_z2_gas2": lambda: trainer_case(
            scratch, "gc_z2_gas2", *llama, 2, gradient_checkpointing=True,
            gradient_accumulation_steps=2,
        ),
        "compile_z2": lambda: trainer_case(
            scratch, "compile_z2", *llama, 2, torch_compile=True,
            torch_compile_backend="aot_eager",
            per_device_eval_batch_size=2,  # the training shapes: no second compilation
        ),
        "compile_z3": lambda: trainer_case(
            scratch, "compile_z3", *llama, 3, torch_compile=True,
            torch_compile_backend="aot_eager", per_device_eval_batch_size=2,
        ),
        "eval_only_z3": lambda: trainer_case(scratch, "eval_only_z3", *llama, 3, train=False),
        "albert_z3": lambda: trainer_case(
            scratch, "albert_z3", hf.AlbertForMaskedLM, hf.AlbertConfig(**ALBERT), "mlm", 3
        ),
        "bart_z3": lambda: trainer_case(
            scratch, "bart_z3", hf.BartForConditionalGeneration, hf.BartConfig(**BART),
            "seq2seq", 3, predict_with_generate=True, generation_max_length=TARGET + 2,
            generation_num_beams=1,
        ),
        "fp16_z2": lambda: trainer_case(
            scratch, "fp16_z2", *llama, 2, ds=FP16, fp16=True, max_steps=6
        ),
        "fp16_z3": lambda: trainer_case(
            scratch, "fp16_z3", *llama, 3, ds=FP16, fp16=True, max_steps=6
        ),
        "trainer_fp16_auto_cast_z2": lambda: trainer_case(
            scratch, "trainer_fp16_auto_cast_z2", *llama, 2, fp16=True, max_steps=6
        ),
        "best_model_z3": lambda: trainer_case(
            scratch, "best_model_z3", *llama, 3, evals=True, max_steps=4, eval_strategy="steps",
            eval_steps=2, save_strategy="steps", save_steps=2, load_best_model_at_end=True,
        ),
        "save_model_z3": lambda: save_model_case(scratch),
        "odd_params_z2": lambda: odd_params_case(2),
        "odd_params_z3": lambda: odd_params_case(3),
        "plugin_fp16_z1": lambda: plugin_fp16_case(1),
        "plugin_fp16_z3": lambda: plugin_fp16_case(3),
        "two_models": two_models_case,
        "accumulate_generate_z3": accumulate_generate_case,
        "save_no_gather_z3": lambda: save_without_gather_case(scratch),  # last: unsets HF's ds
    }  # fmt: skip


def main(scratch):
    # DeepSpeed's CPU accelerator calls fp16 unsupported where oneDNN has no fp16 kernels (this
    # host) and refuses the fp16 runs; its loss scaling does not depend on the device, so the
    # recorder says fp16 is supported. On minispeed the line changes nothing (fp16 runs on the
    # CPU; `get_accelerator()` hands out a new view each call).
    get_accelerator().is_fp16_supported = lambda: True
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # accelerate on a CPU-only host (record_ds_trainer.py)
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    return {name: case() for name, case in cases(scratch).items()}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record

    scratch = Path(os.environ.get("TRAINER_SCRATCH", tempfile.gettempdir())) / "ds_hf_more"
    record(main(scratch), FIXTURE, scratch=scratch)
