"""ZeRO-Inference as transformers documents it: `deepspeed.initialize(model=..., config=...)` at
stage 3 with no optimizer, then `engine.module.generate(...)`. The model comes from
`from_pretrained` under `HfDeepSpeedConfig`, so it is built under `zero.Init` and holds only
shards. On 2 ranks the generated tokens equal the unsharded model's own `generate`, each rank
keeps only its shards, and the engine refuses to step (Note [stage 3 without an optimizer]).

Twice: in fp32, and in bf16 with `offload_param: cpu` (ZeRO-Inference's usual config), whose
tokens equal the unsharded model's in bf16. In both, what a rank holds (`zero.measure` of
`engine.forward_only_zero`) is the parameter shards in the config's dtype and nothing else, as
`forward_only_state_bytes` predicts: in bf16 no fp32 master, where the engine's SGD of learning
rate 0 used to keep one (4 bytes per parameter beside the shard's 2)."""

from __future__ import annotations

import pytest
import torch

from minispeed.core.testing import run_distributed

transformers = pytest.importorskip("transformers")

CONFIG = {  # a training config reused: its offload_optimizer has nothing to offload here
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "offload_optimizer": {"device": "cpu"},
    },
}
BF16_OFFLOAD = {
    "train_micro_batch_size_per_gpu": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {  # the biases and layer norms persist, the rest is released
        "stage": 3,
        "stage3_param_persistence_threshold": 100,
        "offload_param": {"device": "cpu"},
    },
}
CONFIGS = {"fp32": CONFIG, "bf16": BF16_OFFLOAD}


def _generate(rank: int, world_size: int, path: str) -> dict:
    return {name: _generate_with(rank, path, config) for name, config in CONFIGS.items()}


def _generate_with(rank: int, path: str, config: dict) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import minispeed.engine as deepspeed
    import minispeed.zero as zero
    from minispeed.zero.memory import padding_allowance, predict

    keep = HfDeepSpeedConfig(config)  # noqa: F841 (transformers reads it through a weak reference)
    model = AutoModelForCausalLM.from_pretrained(path)
    shards_only = all(p.data.numel() == 0 for p in model.parameters())
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config)
    engine.module.eval()
    prompt = torch.tensor([[5, 17, 42, 8, 99][: 3 + rank]])  # ranks generate different prompts
    with torch.no_grad():
        tokens = engine.module.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    try:
        engine.step()
        refused = None
    except RuntimeError as e:
        refused = str(e)
    persistent = {
        sp.param for sp in engine.forward_only_zero.strategy.sharded_params() if sp.persistent
    }
    still_sharded = all(p.data.numel() == 0 or p in persistent for p in model.parameters())
    shards = engine.forward_only_zero
    held = zero.measure(shards, model)
    engine.destroy()
    return dict(prompt=prompt, tokens=tokens, shards_only=shards_only, optimizer=optimizer,
                refused=refused, still_sharded=still_sharded, held=held,
                predicted=predict(shards), allowance=padding_allowance(shards))  # fmt: skip


def test_zero3_without_an_optimizer_generates_as_the_whole_model(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # a GPT-2 whose head is tied to the embedding, as transformers ties it
    config = GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    whole = GPT2LMHeadModel(config).eval()
    whole.save_pretrained(tmp_path)
    for ranks in run_distributed(_generate, world_size=2, args=(str(tmp_path),), timeout_s=240):
        for name, res in ranks.items():
            model = whole if name == "fp32" else whole.to(torch.bfloat16)
            with torch.no_grad():
                want = model.generate(
                    res["prompt"], max_new_tokens=6, do_sample=False, pad_token_id=0
                )
            assert torch.equal(res["tokens"], want), name
            assert res["shards_only"] and res["still_sharded"], name
            assert res["optimizer"] is None and "needs an optimizer" in res["refused"], name
            held, predicted, slack = res["held"], res["predicted"], res["allowance"]
            assert held.master == held.grads == held.optimizer_states == 0, (name, held)
            assert 0 <= held.params - predicted.params <= slack.params, (name, held, predicted)
