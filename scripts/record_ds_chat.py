"""DeepSpeed-Chat's supervised fine-tuning step, on a tiny GPT-2, kept as a reference.

Written as DeepSpeed-Chat's `step1_supervised_finetuning/main.py` and its `utils/ds_utils.py`
write it: the config asks for `offload_param` and `offload_optimizer` together at every stage
(DeepSpeed ignores what the stage cannot honour), switched-off `hybrid_engine` and `tensorboard`
sections with their other keys filled in, `memory_efficient_linear: false`; `HfDeepSpeedConfig`
before the model at stage 3; two weight-decay groups into `FusedAdam` (`DeepSpeedCPUAdam` with
offload); transformers' cosine schedule passed as an object; `model.backward` / `model.step`;
and the ZeRO-3 save's gather (`ds_id`, `ds_status == ZeroParamStatus.NOT_AVAILABLE`,
`GatheredParameters`). In fp32, so every value compares tightly. Recorded on DeepSpeed 0.19.8,
2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_chat.py
```

which writes `tests/engine/fixtures/ds_chat.json`; `tests/engine/test_engine_ds_api_scripts.py`
runs this file with its import lines changed to minispeed's.
"""

import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler
from transformers.integrations import HfDeepSpeedConfig

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_chat.json"
CASES = [(2, True), (3, False), (3, True)]  # (zero stage, offload)


def ds_config(stage, offload):
    """DeepSpeed-Chat's `get_train_ds_config`, in fp32."""
    device = "cpu" if offload else "none"
    return {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10,
        "zero_optimization": {
            "stage": stage,
            "offload_param": {"device": device},
            "offload_optimizer": {"device": device},
            "stage3_param_persistence_threshold": 1e4,
            "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7,
            "memory_efficient_linear": False,
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "hybrid_engine": {
            "enabled": False,
            "max_out_tokens": 512,
            "inference_tp_size": 1,
            "release_inference_cache": False,
            "pin_parameters": True,
            "tp_gather_partition_size": 8,
        },
        "tensorboard": {"enabled": False, "output_path": "/tmp/ds_tb", "job_name": "step1_tb"},
    }


def _z3_params_to_fetch(params):
    return [
        p for p in params if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
    ]


def run(stage, offload):
    config = ds_config(stage, offload)
    dschf = HfDeepSpeedConfig(config) if stage == 3 else None  # noqa: F841 (kept alive, as there)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    )
    no_decay = ["bias", "ln_"]
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(d in n for d in no_decay)],
            "weight_decay": 0.1,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(d in n for d in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = (DeepSpeedCPUAdam if offload else FusedAdam)(groups, lr=1e-2, betas=(0.9, 0.95))
    scheduler = get_scheduler(
        "cosine", optimizer=optimizer, num_warmup_steps=1, num_training_steps=4
    )
    model, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=config,
        lr_scheduler=scheduler,
        dist_init_required=True,
    )
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(1 + rank)
    losses = []
    for _ in range(8):
        ids = torch.randint(0, 64, (2, 8), generator=g)
        loss = model(
            input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False
        ).loss
        model.backward(loss)
        model.step()
        losses.append(loss.item())
    sums = {}
    for name, v in model.module.named_parameters():  # DeepSpeed-Chat's save_zero_three_model
        with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=stage == 3):
            sums[name] = float(v.data.double().cpu().sum())
    return {"losses": losses, "lr": scheduler.get_last_lr(), "sums": sums}


def main():
    deepspeed.init_distributed(dist_backend="gloo")
    return {
        f"stage{stage}{'_offload' if offload else ''}": run(stage, offload)
        for stage, offload in CASES
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record  # refuses minispeed under DeepSpeed's name

    record(main(), FIXTURE)
