"""`auto_plan` on more Hugging Face families than the test suite runs, on 2 gloo processes.

For each family (tiny random configs, dropout off) the model is split by
`minispeed.tensor_parallel.auto_plan` over 2 ranks and runs its own `labels=` loss forward and
backward; printed per family: the largest difference from the unsplit model's loss and logits,
and the largest gradient difference relative to that parameter's largest gradient (slices
gathered back). A family `auto_plan` refuses prints the refusal.

```bash
.venv/bin/python scripts/check_autotp_families.py [family ...]
```
"""

from __future__ import annotations

import sys

import torch
import transformers as t

import minispeed.tensor_parallel as tp
from minispeed.core.testing import run_distributed

GQA = dict(vocab_size=48, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
GPTJ = dict(vocab_size=48, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
PHI = dict(vocab_size=48, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
           num_attention_heads=4, max_position_embeddings=32, resid_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip
FALCON = dict(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
FAMILIES = {
    "mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**GQA)),
    "gemma": lambda: t.GemmaForCausalLM(t.GemmaConfig(**GQA, head_dim=8)),
    "stablelm": lambda: t.StableLmForCausalLM(t.StableLmConfig(**GQA)),
    "olmo": lambda: t.OlmoForCausalLM(t.OlmoConfig(**GQA)),
    "starcoder2": lambda: t.Starcoder2ForCausalLM(
        t.Starcoder2Config(**GQA, residual_dropout=0.0, embedding_dropout=0.0)
    ),
    "gptj": lambda: t.GPTJForCausalLM(t.GPTJConfig(**GPTJ)),
    "phi3": lambda: t.Phi3ForCausalLM(t.Phi3Config(**GQA, pad_token_id=0)),
    "phi_qk_norm": lambda: t.PhiForCausalLM(t.PhiConfig(**PHI, qk_layernorm=True)),
    "gemma3": lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(**GQA, head_dim=8)),
    "olmo2": lambda: t.Olmo2ForCausalLM(t.Olmo2Config(**GQA)),
    "bloom": lambda: t.BloomForCausalLM(
        t.BloomConfig(vocab_size=48, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0)
    ),
    "bloom_slopes_8_heads": lambda: t.BloomForCausalLM(
        t.BloomConfig(vocab_size=48, hidden_size=32, n_layer=1, n_head=8, hidden_dropout=0.0)
    ),
    "falcon": lambda: t.FalconForCausalLM(t.FalconConfig(**FALCON)),
    "falcon_new_arch": lambda: t.FalconForCausalLM(
        t.FalconConfig(**FALCON, new_decoder_architecture=True, num_kv_heads=2, bias=True)
    ),
    "falcon_mha": lambda: t.FalconForCausalLM(
        t.FalconConfig(**FALCON, multi_query=False, parallel_attn=False, bias=True)
    ),
    "falcon_alibi": lambda: t.FalconForCausalLM(
        t.FalconConfig(**FALCON, multi_query=False, alibi=True)
    ),
}
IDS = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(3))


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return FAMILIES[name]()


def _body(rank: int, world_size: int) -> dict:
    out = {}
    for name in sys.argv[1:] or FAMILIES:
        model = _model(name)
        try:
            plan = tp.auto_plan(model)
        except ValueError as err:
            out[name] = str(err)
            continue
        tp.parallelize(model, plan, None)
        result = model(input_ids=IDS, labels=IDS)
        result.loss.backward()
        grads = tp.unshard_module(model, tp.TensorGroup.of(None), grads=True)
        out[name] = (result.loss.detach(), result.logits.detach(), grads)
    return out


def main() -> None:
    got = run_distributed(_body, world_size=2, timeout_s=300)[0]
    for name in got:
        if isinstance(got[name], str):
            print(f"{name}: refused: {got[name][:110]}...")
            continue
        loss, logits, grads = got[name]
        model = _model(name)
        want = model(input_ids=IDS, labels=IDS)
        want.loss.backward()
        grad_rel = max(
            ((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-6)).item()
            for n, p in model.named_parameters()
            if p.grad is not None
        )
        print(
            f"{name}: loss {abs(loss - want.loss).item():.1e}, logits "
            f"{(logits - want.logits).abs().max().item():.1e}, gradients (relative) {grad_rel:.1e}"
        )


if __name__ == "__main__":
    main()
