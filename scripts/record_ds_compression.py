"""DeepSpeed's compression library (init_compression, the engine's schedule, redundancy_clean)
on a tiny BERT-like model: what minispeed.compression must reproduce.

DeepSpeed 0.19.8 removed the library (its `deepspeed/compression` keeps a `helper` shim only,
and its config refuses `compression_training`), so this records on DeepSpeed 0.17.6, its last
release with it, in a venv that sees /work/dsvenv's torch 2.13.0 (`dsvenv.pth`) and holds
DeepSpeed 0.17.6 installed from its sdist (`DS_BUILD_OPS=0 pip install --no-deps
--no-build-isolation deepspeed-0.17.6.tar.gz`):

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /tmp/ds-old/venv17/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_compression.py
```

which writes `tests/engine/fixtures/ds_compression.json`. For each case (a `compression_training`
section), two gloo ranks: build the model (seed 0), `init_compression`, record the outputs on a
fixed batch and every learned-mask score (topk; minispeed's test loads them, as they are random
draws), train `STEPS` steps through `deepspeed.initialize`'s engine (SGD, ZeRO stage 0, fp32),
recording each step's loss, then `redundancy_clean` and record every parameter's shape and the
outputs again. The channel-pruning case trains a small CNN on 6x6 images instead. The
layer-reduction case initializes a 2-layer student from a 4-layer teacher.
`tests/engine/test_compression_ds.py` runs this file with its import lines changed to
minispeed's and compares.
"""

import math
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.compression.compress import init_compression, redundancy_clean
from torch import nn

VOCAB, DIM, HEAD_DIM, TOKENS, BATCH, STEPS = 16, 8, 4, 4, 2, 6
FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_compression.json"


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x):  # (B, T, DIM); heads from q's width, so pruned heads shrink it
        b, t, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        heads = q.shape[-1] // HEAD_DIM
        q, k, v = (y.view(b, t, heads, HEAD_DIM).transpose(1, 2) for y in (q, k, v))
        att = (q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, t, heads * HEAD_DIM))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = Attention(), Mlp()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Bert(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.fc = nn.Conv2d(8, 8, 3, padding=1), nn.Linear(8, VOCAB)

    def forward(self, images):  # (B, 3, 6, 6) -> (B, 1, VOCAB)
        x = torch.relu(self.conv2(torch.relu(self.bn1(self.conv1(images)))))
        return self.fc(x.mean(dim=(2, 3))).unsqueeze(1)


def batch(seed, images=False):
    g = torch.Generator().manual_seed(seed)
    if images:
        return torch.randn(BATCH, 3, 6, 6, generator=g), torch.randint(
            0, VOCAB, (BATCH, 1), generator=g
        )
    tokens = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g)
    return tokens, torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g)


def section(technique, enabled_shared, groups):
    return {technique: {"shared_parameters": {"enabled": True, **enabled_shared},
                        "different_groups": groups}}  # fmt: skip


WQ = "weight_quantization"
AQ = "activation_quantization"
CASES = {
    "wq_symmetric_aq_static": {
        **section(WQ, {"quantize_weight_in_forward": True, "quantize_groups": 2,
                       "quantization_type": "symmetric", "schedule_offset": 2},
                  {"wq1": {"params": {"start_bits": 8, "target_bits": 8},
                           "modules": ["attn.q", "attn.k", "attn.v", "attn.o"]},
                   "wq2": {"params": {"start_bits": 8, "target_bits": 4},
                           "modules": ["mlp", "embed"]}}),
        **section(AQ, {"quantization_type": "symmetric", "range_calibration": "static",
                       "schedule_offset": 3},
                  {"aq1": {"params": {"bits": 8}, "modules": ["fc2"]}}),
    },
    "wq_asymmetric_aq_dynamic": {
        **section(WQ, {"quantize_weight_in_forward": True, "quantization_type": "asymmetric",
                       "schedule_offset": 0},
                  {"wq1": {"params": {"start_bits": 8, "target_bits": 4},
                           "modules": ["layers"]},
                   "wq2": {"params": {"start_bits": 8, "target_bits": 8},
                           "modules": ["embed"]}}),
        **section(AQ, {"quantization_type": "asymmetric", "range_calibration": "dynamic",
                       "schedule_offset": 1},
                  {"aq1": {"params": {"bits": 8}, "modules": ["attn.o", "head"]}}),
    },
    "prune_l1_shrink": {
        **section("sparse_pruning", {"method": "l1", "schedule_offset": 2,
                                     "schedule_offset_end": 2},
                  {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["attn.q", "attn.k"]}}),
        **section("row_pruning", {"method": "l1", "schedule_offset": 3},
                  {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["fc1"],
                           "related_modules": [["fc2"]]}}),
        **section("head_pruning", {"method": "topk", "num_heads": 2, "schedule_offset": 2},
                  {"hp1": {"params": {"dense_ratio": 0.5}, "modules": ["attn.o"],
                           "related_modules": [["attn.q", "attn.k", "attn.v"]]}}),
    },
    "prune_topk_in_place": {
        **section("sparse_pruning", {"method": "topk", "schedule_offset": 1,
                                     "schedule_offset_end": 1},
                  {"sp1": {"params": {"dense_ratio": 0.25}, "modules": ["fc2"]}}),
        **section("row_pruning", {"method": "topk", "schedule_offset": 2},
                  {"rp1": {"params": {"dense_ratio": 0.5}, "modules": ["attn.v"]}}),
    },
    "channel_topk_shrink": section(  # l1 fails in DeepSpeed on torch 2.13 (linalg.norm, 3 dims)
        "channel_pruning", {"method": "topk", "schedule_offset": 2},
        {"cp1": {"params": {"dense_ratio": 0.5}, "modules": ["conv1"],
                 "related_modules": [["bn1", "conv2"]]}}),
}  # fmt: skip


def config(compression):
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        # Plain SGD: DeepSpeed's stage 0 gives a parameter no gradient reached (topk scores
        # before their technique's offset) a zero gradient, which Adam steps (its count and
        # weight decay advance); minispeed skips it as torch.optim does. SGD without momentum
        # or decay moves neither, so the comparison is of compression alone.
        "optimizer": {"type": "SGD", "params": {"lr": 0.2}},
        "zero_optimization": {"stage": 0},
        "compression_training": compression,
    }


def outputs(model, images=False):
    with torch.no_grad():
        return model(batch(1000, images)[0]).flatten().tolist()


def run_case(rank, name, scores=None):
    torch.manual_seed(0)
    images = name.startswith("channel")
    model = Cnn() if images else Bert()
    ds_config = config(CASES[name])
    model = init_compression(model, ds_config)
    record = {"case": name}
    if scores is None:
        record["scores"] = {n: p.detach().flatten().tolist()
                            for n, p in model.named_parameters() if "scores" in n}  # fmt: skip
    else:  # the random draws DeepSpeed made, given back
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "scores" in n:
                    p.copy_(torch.tensor(scores[n]).view_as(p))
    record["outputs_after_init"] = outputs(model, images)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(100 * rank + step, images)
        logits = engine(tokens)
        loss = nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    record["losses"] = losses
    engine.eval()
    record["outputs_after_training"] = outputs(engine.module, images)
    model = redundancy_clean(engine.module, ds_config)
    record["shapes_after_clean"] = {n: list(p.shape) for n, p in model.named_parameters()}
    record["outputs_after_clean"] = outputs(model, images)
    engine.destroy()
    return record


def layer_reduction():
    torch.manual_seed(0)
    teacher = Bert(layers=4)
    student = Bert(layers=2)
    reduction = {"layer_reduction": {"enabled": True, "keep_number_layer": 2,
                                     "module_name_prefix": "layers", "teacher_layer": [1, 3],
                                     "other_module_name": ["embed", "head"]}}  # fmt: skip
    student = init_compression(student, config(reduction), teacher_model=teacher)
    return {"case": "layer_reduction", "outputs_after_init": outputs(student),
            "teacher_outputs": outputs(teacher)}  # fmt: skip


def main(scores=None):
    rank = dist.get_rank()
    records = [run_case(rank, name, None if scores is None else scores[name]) for name in CASES]
    return [*records, layer_reduction()]


def keep_sparse_offset_end():
    """DeepSpeed 0.17.6's scheduler compares the step with `sparse_pruning`'s
    `schedule_offset_end`, which its config reader keeps for the snip_momentum method only: l1
    and topk sparse pruning through the engine raise KeyError at the first step past
    `schedule_offset`. Recording only, the reader keeps the key as written (default: the
    offset, the reader's own default for snip_momentum), which is what the scheduler reads."""
    from deepspeed.compression import config as ds_compression_config

    read = ds_compression_config.get_sparse_pruning_shared_parameters

    def patched(param_dict):
        out = read(param_dict)
        shared = param_dict.get("shared_parameters", {})
        out.setdefault(
            "schedule_offset_end", shared.get("schedule_offset_end", out["schedule_offset"])
        )
        return out

    ds_compression_config.get_sparse_pruning_shared_parameters = patched


if __name__ == "__main__":
    from ds_fixture import record  # scripts/ is on sys.path when run as a script

    keep_sparse_offset_end()
    deepspeed.init_distributed()
    record(main(), FIXTURE)
