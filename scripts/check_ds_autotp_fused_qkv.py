"""DeepSpeed 0.19.8's AutoTP (`init_inference(tensor_parallel={"tp_size": 2})`) on a tiny Phi-3,
whose fused `qkv_proj` minispeed's `auto_plan` splits: prints each rank's largest logit difference
from the unsplit model, or the error it raises. Not a fixture: it shows what DeepSpeed does with
this layout under transformers 5.24 (`Phi3Attention` reads q's width from
`config.num_attention_heads`, which DeepSpeed does not divide).

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/check_ds_autotp_fused_qkv.py
```

Measured: both ranks raise `RuntimeError: mat1 and mat2 shapes cannot be multiplied (14x32 and
16x32)` (the attention's output keeps the whole q width, `o_proj` takes half).
"""

from __future__ import annotations

import os

import deepspeed
import torch
import transformers as t


def main() -> None:
    torch.manual_seed(0)
    model = t.Phi3ForCausalLM(t.Phi3Config(
        vocab_size=48, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        pad_token_id=None, bos_token_id=0, eos_token_id=None,
    )).eval()  # fmt: skip
    ids = torch.randint(2, 48, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    deepspeed.init_distributed("gloo")
    rank = os.environ["RANK"]
    try:
        engine = deepspeed.init_inference(
            model, tensor_parallel={"tp_size": 2}, dtype=torch.float32
        )
        with torch.no_grad():
            got = engine(ids).logits
        print(f"rank {rank}: largest logit difference {(got - want).abs().max().item():.1e}")
    except RuntimeError as err:
        print(f"rank {rank}: {type(err).__name__}: {err}")


if __name__ == "__main__":
    main()
