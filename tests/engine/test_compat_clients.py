"""transformers' Trainer and accelerate's own loop run on minispeed, through the `deepspeed`
distribution of packages/deepspeed_compat, as they ran on DeepSpeed 0.19.8.

One launch, `accelerate launch --config_file scripts/accelerate_deepspeed.yaml` (2 processes),
runs two recorders unchanged, one after the other in the same processes:

- `scripts/record_ds_trainer.py`: a Trainer fine-tune of a tiny GQA `LlamaForCausalLM` loaded with
  `from_pretrained` (partitioned under ZeRO-3, `HfDeepSpeedConfig`), its ds_config all `"auto"`,
  at ZeRO-2 and ZeRO-3, offload none and cpu: per-step losses, learning rates and gradient
  norms, `evaluate()`, `save_model()` reloaded in a plain process, and a second Trainer resumed
  from the step-3 checkpoint;
- `scripts/record_ds_hf_families.py`: T5 (one embedding shared three ways, its vocabulary grown,
  the `Seq2SeqTrainer`'s `predict_with_generate`: beam search under ZeRO-3), BERT's masked-LM
  head (tied decoder) and Mixtral (fused 3-D experts, loaded group by group) through the Trainer
  at ZeRO-3, each loaded with `from_pretrained` into the shards: per-step losses and
  `evaluate()`;
- `scripts/record_ds_trl.py`: TRL's `SFTTrainer` (plain and with a LoRA adapter, the adapter saved
  alone) and `DPOTrainer`, whose reference model TRL prepares itself with `deepspeed.initialize`
  from the ds_config before the Trainer fills its `"auto"` values, with dotted top-level keys,
  at ZeRO-2 and ZeRO-3; `GRPOTrainer` (sampling under ZeRO-3) and `RewardTrainer` at ZeRO-3:
  what each logs per step;
- `scripts/record_ds_accelerate.py`: accelerate's loop (`DummyOptim` / `DummyScheduler`,
  `accumulate`, `clip_grad_norm_`, `save_state` / `load_state`), at ZeRO-2 with the plugin from
  `accelerate launch`'s config and at ZeRO-3 with the plugin in code.

Every number is compared with DeepSpeed's record (`fixtures/ds_trainer.json`,
`fixtures/ds_hf_families.json`, `fixtures/ds_trl.json`, `fixtures/ds_accelerate.json`) within 2e-4 relative; a resumed run must repeat minispeed's own
uninterrupted steps exactly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_scripts

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TRAINER = json.loads((FIXTURES / "ds_trainer.json").read_text())
ACCELERATE = json.loads((FIXTURES / "ds_accelerate.json").read_text())
FAMILIES = json.loads((FIXTURES / "ds_hf_families.json").read_text())
TRL = json.loads((FIXTURES / "ds_trl.json").read_text())
REL = 2e-4
LAUNCH = [
    sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
    "--config_file", "scripts/accelerate_deepspeed.yaml",
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("compat_clients")
    scripts = [
        "record_ds_trainer.py",
        "record_ds_hf_families.py",
        "record_ds_trl.py",
        "record_ds_accelerate.py",
    ]
    return ds_scripts.run_recorder(scripts, out, launcher=LAUNCH)


def _steps_match(ours: list[dict], ref: list[dict], where: str) -> None:
    assert len(ours) == len(ref), (where, ours, ref)
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert a.keys() == b.keys(), (where, a, b)
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=REL, abs=1e-12), (where, i, key, a, b)


@pytest.mark.parametrize("run", ["z2-none", "z2-cpu", "z3-none", "z3-cpu"])
def test_trainer_matches_deepspeed(runs: list[dict], run: str) -> None:
    for rank, (mine, ref) in enumerate(zip(runs, TRAINER["ranks"], strict=True)):
        ours, theirs = mine["record_ds_trainer.py"][run], ref[run]
        _steps_match(ours["steps"], theirs["steps"], f"rank {rank} {run}")
        assert [s["loss"] for s in ours["steps"]][-1] < ours["steps"][0]["loss"] - 0.2  # learns
        assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=REL)
        # the resumed Trainer repeats the uninterrupted steps 4-6 (and so DeepSpeed's)
        assert ours["resumed_steps"] == ours["steps"][-3:], (rank, run)
        if rank == 0:  # save_model() reloaded by from_pretrained in a plain process
            saved = ours["saved_model_eval_loss"]
            assert saved == pytest.approx(theirs["saved_model_eval_loss"], rel=REL)
            assert saved == pytest.approx(ours["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("run", ["z2", "z3"])
def test_accelerate_loop_matches_deepspeed(runs: list[dict], run: str) -> None:
    for rank, (mine, ref) in enumerate(zip(runs, ACCELERATE["ranks"], strict=True)):
        ours, theirs = mine["record_ds_accelerate.py"][run], ref[run]
        _steps_match(ours["steps"], theirs["steps"], f"rank {rank} {run}")
        _steps_match(ours["resumed_steps"], theirs["resumed_steps"], f"rank {rank} {run} resumed")
        assert ours["resumed_steps"] == ours["steps"][-2:], (rank, run)


@pytest.mark.parametrize("family", ["t5", "bert", "mixtral"])
def test_model_families_load_partitioned_and_train_as_deepspeed(runs: list[dict], family: str):
    for rank, (mine, ref) in enumerate(zip(runs, FAMILIES["ranks"], strict=True)):
        ours, theirs = mine["record_ds_hf_families.py"][family], ref[family]
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=REL), (rank, family)
        assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=REL), (rank, family)
        assert ours.get("generated") == theirs.get("generated"), (rank, family)  # T5's beams


def test_accelerate_examples_save_on_every_rank_as_deepspeed(runs: list[dict]) -> None:
    """transformers' `*_no_trainer.py` save (`save_pretrained(state_dict=get_state_dict(model))`
    on every rank) of a tied-embedding model at ZeRO-3: the ranks that do not write inspect
    their own `state_dict()` of placeholders without failing, and rank 0's saved model,
    reloaded, evaluates as DeepSpeed's."""
    for rank, (mine, ref) in enumerate(zip(runs, FAMILIES["ranks"], strict=True)):
        ours, theirs = mine["record_ds_hf_families.py"]["qwen2_accelerate"], ref["qwen2_accelerate"]
        assert ours["losses"] == pytest.approx(theirs["losses"], rel=REL), rank
        if rank == 0:
            assert ours["saved_model_loss"] == pytest.approx(theirs["saved_model_loss"], rel=REL)


@pytest.mark.parametrize("name", sorted(TRL["ranks"][0]))
def test_trl_trainers_match_deepspeed(runs: list[dict], name: str) -> None:
    """TRL's SFT (plain and LoRA), DPO, GRPO and reward trainers log DeepSpeed's values at every
    step. DPO's reference model is TRL's own `deepspeed.initialize` without an optimizer, from a
    ds_config still holding `"auto"` and TRL's dotted top-level keys: its rewards leave 0 once
    the policy moves, and match DeepSpeed's only if the reference stayed the initial model.
    GRPO samples under ZeRO-3 with every parameter gathered and the hooks "stripped"
    (`parameter_offload`); its KL term is against a ZeRO-3 reference."""
    for rank, (mine, ref) in enumerate(zip(runs, TRL["ranks"], strict=True)):
        ours, theirs = mine["record_ds_trl.py"][name], ref[name]
        _steps_match(ours["steps"], theirs["steps"], f"rank {rank} {name}")
        last = ours["steps"][-1]
        if name.startswith("dpo"):
            assert abs(last["rewards/chosen"]) > 1e-3  # the policy moved
        if name.startswith("grpo"):
            assert last["kl"] > 1e-3  # away from the reference
        if name.startswith("sft_lora") and rank == 0:  # the adapter saved alone
            assert ours["adapter_keys"] == theirs["adapter_keys"]
            assert ours["adapter_abs_sum"] == pytest.approx(theirs["adapter_abs_sum"], rel=REL)
