"""Bytes per rank of ZeRO-Inference (stage 3 without an optimizer), before and after: 2 gloo ranks.

The same bf16 model sharded at stage 3 twice, each followed by one forward under ``no_grad``:

- **before**: ``zero.shard(model, torch.optim.SGD(params, lr=0))``, an optimizer that is never
  stepped: what `deepspeed.initialize(model=..., config=...)` without an optimizer built until
  stage 3 had a forward-only mode (an fp32 master beside each bf16 shard);
- **after**: ``zero.shard(model, None)``, `ForwardOnly` (packages/zero stage3/forward_only.py):
  the shards alone.

Reported per rank, by `zero.measure` (every distinct storage the model and the ZeRO objects
hold, by column), beside `zero.memory.predict`'s parameters and masters (`forward_only_state_bytes`
for after; a forward holds no gradient, so the training formula's gradient column is left out).

Run (the figures in docs/packages/zero.md, "Stage 3 without an optimizer"):

```bash
python benchmarks/zero_inference_memory.py                 # GPT-2 small (124M), transformers
python benchmarks/zero_inference_memory.py --model tiny    # 2 layers of width 64
```
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from minispeed.core.testing import run_distributed

# GPT2Config keyword arguments: "gpt2" is GPT-2 small's shape (transformers' defaults).
MODELS = {"gpt2": {}, "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 1000}}


def _held(rank: int, world_size: int, model_name: str) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    import minispeed.zero as zero
    from minispeed.zero.memory import predict

    out = {}
    for case in ("before", "after"):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(**MODELS[model_name])).to(torch.bfloat16).eval()
        sgd = torch.optim.SGD(model.parameters(), lr=0.0) if case == "before" else None
        shards = zero.shard(
            model, sgd, zero.ZeroConfig(stage=3),
            precision=zero.MixedPrecision(param_dtype=torch.bfloat16),
        )  # fmt: skip
        with torch.no_grad():
            model(torch.tensor([[5, 17, 42, 8]]))
        out[case] = dict(held=zero.measure(shards, model), predicted=predict(shards))
        out["numel"] = sum(sp.numel for sp in shards.strategy.sharded_params())
        shards.close()
        del model, shards, sgd
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    args = parser.parse_args()
    ranks = run_distributed(_held, world_size=2, args=(args.model,), timeout_s=600)
    numel = ranks[0]["numel"]
    table = Table(title=f"{args.model} ({numel:,} parameters), bf16, 2 ranks: bytes held per rank")
    for col in ("rank", "case", "params", "fp32 masters", "grads", "total", "predicted"):
        table.add_column(col, justify="right")
    for rank, res in enumerate(ranks):
        for case in ("before", "after"):
            held, pred = res[case]["held"], res[case]["predicted"]
            table.add_row(
                str(rank), case, f"{held.params:,}", f"{held.master:,}", f"{held.grads:,}",
                f"{held.total:,}", f"{pred.params + pred.optimizer:,}",
            )  # fmt: skip
        ratio = res["before"]["held"].total / res["after"]["held"].total
        table.add_row(str(rank), "before / after", "", "", "", f"{ratio:.2f}x", "")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
