"""Vision and diffusion-style models through accelerate on DeepSpeed, kept as a reference (2 processes, CPU).

The other client recorders train decoder language models; users also train image models through
accelerate with a DeepSpeed plugin (diffusers' and timm's example scripts: a client
`torch.optim.AdamW` over the trainable parameters, `accelerator.prepare(model, optimizer)`,
`accelerator.backward`, `get_state_dict` / `save_model` at the end). Tiny models of this file's own
(no downloads), each a few steps on each rank's own batch:

- `cnn_z0` .. `cnn_z3`: a small CNN with `BatchNorm2d` (running statistics and
  `num_batches_tracked` buffers that each rank updates from its own batch) and a buffer drawn at
  init (a colour mix), fed `channels_last` images, then one evaluation-mode forward (the running
  statistics used);
- `cnn_bf16_z2`, `cnn_bf16_z3`: the CNN in bf16 (a bf16 image through the colour mix buffer);
  `cnn_nomix_bf16_z2`, `_z3`: without the colour mix (BatchNorm's statistics the only buffers);
- `cnn_channels_last_z0`, `_z2`, `_z3`: the CNN with its weights in `channels_last` too (timm's
  `--channels-last`: `model.to(memory_format=torch.channels_last)` before `prepare`);
- `cnn_resume_z2`, `cnn_resume_z3`: the CNN's run, `accelerator.save_state`, then a fresh
  model (drawn per rank) prepared and `load_state`d: the parameters and buffers each rank holds,
  and the loss of one more step;
- `vit_z0`, `vit_bf16_z2`, `vit_bf16_z3`: a small ViT (a patch `Conv2d`, a class token and a position
  embedding as bare `nn.Parameter`s, one pre-norm attention block), in fp32 and in bf16;
- `unet_z2`, `unet_z3`: a small UNet (`GroupNorm`, a strided `Conv2d` down, a `ConvTranspose2d`
  up, a skip connection concatenated, and one `Conv2d` applied twice in the forward);
- `odd_z1`, `odd_z2`, `odd_z3`: parameters of 7 elements (not divisible by the world size) and of
  one element, and a frozen "text encoder" submodule (`requires_grad_(False)`, left out of the
  optimizer, as diffusers' scripts do) whose output conditions the model;
- `empty_z1`, `empty_z3`: the same with a parameter of no element added to the output;
  `scalar_z1`, `scalar_z3`: with the one-element parameter 0-d (`torch.tensor(1.5)`);
- `unseeded_z0`, `unseeded_z2`, `unseeded_z3`, `unseeded_odd_z0`, `unseeded_odd_z1`,
  `unseeded_odd_z3`: the CNN and the text-encoder model initialized differently on each rank (the
  seed is the rank: a script that forgot to seed).

Per case: the loss at each step; each rank's own parameters and buffers after training
(`unwrap_model(model).named_parameters()` / `named_buffers()`; at ZeRO-3 the parameters gathered
with `GatheredParameters`), each as `[sum, abs sum, a position-weighted sum]`;
`accelerator.get_state_dict(model)` on each rank (what it holds); `accelerator.save_model`, the
saved safetensors' keys and digests read back on rank 0. A case that raises keeps what it
had and the error, in the phase it was in (DeepSpeed fails
`cnn_channels_last_*`, `cnn_bf16_*`, `scalar_*` and `empty_z3`).

The accelerate state is started with `backend="gloo"` first (a CPU-only host: see
`record_ds_accelerate.py`). Recorded on DeepSpeed 0.19.8, 2 gloo processes on the CPU:

```bash
env -u PYTHONPATH DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run \
    --nproc_per_node 2 scripts/record_ds_vision.py
```

which writes `tests/engine/fixtures/ds_vision.json`. `tests/engine/test_compat_vision.py` runs
this same file, unchanged, on minispeed (the `deepspeed` distribution) and compares.
"""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DeepSpeedPlugin
from torch import nn

FIXTURE = Path(__file__).resolve().parents[1] / "tests/engine/fixtures/ds_vision.json"
STEPS, BATCH, SIDE = 3, 4, 8


def ds_config(stage, bf16=False):
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": stage,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 1000,
    }


class CNN(nn.Module):
    def __init__(self, mix=True):
        super().__init__()
        # No bias before a BatchNorm (as torchvision's): its gradient is 0 but for rounding,
        # which Adam would scale up to steps of the learning rate's size, in any direction.
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)
        # A fixed random colour mix: a buffer drawn at init (different per rank when unseeded)
        mix = torch.eye(3) + 0.1 * torch.randn(3, 3) if mix else None
        self.register_buffer("mix", mix)

    def forward(self, x):
        if self.mix is not None:
            x = F.conv2d(x, self.mix[:, :, None, None])
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


class ViT(nn.Module):
    def __init__(self, dim=16, patch=4):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 1 + (SIDE // patch) ** 2, dim) * 0.02)
        self.norm1 = nn.LayerNorm(dim)
        # No projection bias: the key's bias has gradient 0 but for rounding (the softmax does
        # not see it), which Adam scales up (see CNN).
        self.attn = nn.MultiheadAttention(dim, 2, bias=False, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x[:, 0])


class UNet(nn.Module):
    def __init__(self, ch=8):
        super().__init__()
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, ch)
        self.down = nn.Conv2d(ch, 2 * ch, 3, stride=2, padding=1)
        self.mid = nn.Conv2d(2 * ch, 2 * ch, 3, padding=1)  # applied twice
        self.norm2 = nn.GroupNorm(4, 2 * ch)
        self.up = nn.ConvTranspose2d(2 * ch, ch, 2, stride=2)
        self.out = nn.Conv2d(2 * ch, 3, 3, padding=1)

    def forward(self, x):
        skip = F.silu(self.norm1(self.inp(x)))
        h = self.down(skip)
        h = F.silu(self.norm2(self.mid(F.silu(self.mid(h)))))
        return self.out(torch.cat([self.up(h), skip], 1))


class Odd(nn.Module):
    """Odd-sized parameters and a frozen text encoder conditioning a small conv model; with
    `empty`, a parameter of no element too; with `scalar`, the one-element parameter 0-d."""

    def __init__(self, empty=False, scalar=False):
        super().__init__()
        self.text_encoder = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 7))
        self.text_encoder.requires_grad_(False)
        self.conv = nn.Conv2d(3, 7, 3, padding=1)
        self.odd = nn.Parameter(torch.randn(7) * 0.1)  # 7: not divisible by 2 ranks
        self.scale = nn.Parameter(torch.tensor(1.5) if scalar else torch.tensor([1.5]))
        self.empty = nn.Parameter(torch.zeros(0)) if empty else None
        self.head = nn.Linear(7, 3)

    def forward(self, x, tokens):
        cond = self.text_encoder(tokens).mean(1)  # (B, 7)
        h = self.conv(x).mean((2, 3)) + cond + self.odd
        if self.empty is not None:
            h = h + self.empty.sum()
        return self.head(torch.tanh(h)) * self.scale


def channels_last_cnn():
    return CNN().to(memory_format=torch.channels_last)


def digest(t):
    """`[sum, abs sum, position-weighted sum]` of a tensor, in float64."""
    t = t.detach().double().flatten()
    weights = torch.arange(1, t.numel() + 1, dtype=torch.float64) / max(t.numel(), 1)
    return [t.sum().item(), t.abs().sum().item(), (t * weights).sum().item()]


def fresh(stage, bf16=False):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    plugin = DeepSpeedPlugin(hf_ds_config=ds_config(stage, bf16))
    return Accelerator(deepspeed_plugin=plugin)


def own_parameters(model, stage):
    """Each rank's own parameters (gathered at ZeRO-3) and buffers, by name."""
    params = dict(model.named_parameters())
    out = {}
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        for name, p in params.items():
            out[name] = digest(p)
    buffers = {name: digest(b) for name, b in model.named_buffers()}
    return out, buffers


def run_case(result, scratch, name, build, stage, *, bf16=False, seed=0, batch_fn):
    """One case into `result`; `result["phase"]` names where it is (an error's place)."""
    result["phase"] = "prepare"
    accelerator = fresh(stage, bf16)
    rank = accelerator.process_index
    torch.manual_seed(seed if seed is not None else 100 + rank)
    model = build()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(10 + rank)
    dtype = torch.bfloat16 if bf16 else torch.float32
    result["phase"], result["losses"] = "train", []
    losses = result["losses"]
    model.train()
    for _ in range(STEPS):
        inputs, target = batch_fn(g)
        inputs = [i.to(dtype) if i.is_floating_point() else i for i in inputs]
        loss = F.mse_loss(model(*inputs).float(), target)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
        model.eval()
        inputs, target = batch_fn(g)
        inputs = [i.to(dtype) if i.is_floating_point() else i for i in inputs]
        with torch.no_grad():
            result["eval_loss"] = F.mse_loss(model(*inputs).float(), target).item()
        model.train()
    result["phase"] = "state_dict"
    unwrapped = accelerator.unwrap_model(model)
    result["params"], result["buffers"] = own_parameters(unwrapped, stage)
    state = accelerator.get_state_dict(model)
    result["state_dict"] = {k: digest(v) for k, v in (state or {}).items()}
    result["phase"] = "save_model"
    accelerator.save_model(model, str(scratch / name))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        from safetensors.torch import load_file

        saved = load_file(str(scratch / name / "model.safetensors"))
        result["saved"] = {k: [str(v.dtype), *digest(v)] for k, v in saved.items()}
    accelerator.wait_for_everyone()
    result["phase"] = "done"
    return accelerator, model


def resume_case(result, scratch, name, stage):
    """The CNN trained, `save_state`, then a fresh model drawn per rank `load_state`s it: what
    each rank holds then (BatchNorm's statistics differed per rank at the save), and one step."""
    accelerator, model = run_case(result, scratch, name, CNN, stage, batch_fn=images)
    result["phase"] = "save_state"
    accelerator.save_state(str(scratch / f"{name}_state"))
    accelerator.wait_for_everyone()
    result["phase"] = "load_state"
    accelerator = fresh(stage)
    rank = accelerator.process_index
    torch.manual_seed(200 + rank)
    model = CNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.load_state(str(scratch / f"{name}_state"))
    loaded = accelerator.unwrap_model(model)
    result["loaded_params"], result["loaded_buffers"] = own_parameters(loaded, stage)
    g = torch.Generator().manual_seed(30 + rank)
    (x,), target = images(g)
    loss = F.mse_loss(model(x), target)
    accelerator.backward(loss)
    optimizer.step()
    result["resumed_loss"] = loss.item()
    result["phase"] = "done"


def images(g, out=3):
    x = torch.randn(BATCH, 3, SIDE, SIDE, generator=g)
    return [x.contiguous(memory_format=torch.channels_last)], torch.randn(BATCH, out, generator=g)


def unet_batch(g):
    x = torch.randn(BATCH, 3, SIDE, SIDE, generator=g)
    return [x], torch.randn(BATCH, 3, SIDE, SIDE, generator=g)


def odd_batch(g):
    x = torch.randn(BATCH, 3, SIDE, SIDE, generator=g)
    tokens = torch.randint(0, 11, (BATCH, 5), generator=g)
    return [x, tokens], torch.randn(BATCH, 3, generator=g)


def cases(scratch):
    out = {}
    for stage in range(4):
        out[f"cnn_z{stage}"] = lambda r, s=stage: run_case(
            r, scratch, f"cnn_z{s}", CNN, s, batch_fn=images
        )
    for stage in (2, 3):
        out[f"cnn_bf16_z{stage}"] = lambda r, s=stage: run_case(
            r, scratch, f"cnn_bf16_z{s}", CNN, s, bf16=True, batch_fn=images
        )
        out[f"cnn_nomix_bf16_z{stage}"] = lambda r, s=stage: run_case(
            r,
            scratch,
            f"cnn_nomix_bf16_z{s}",
            lambda: CNN(mix=False),
            s,
            bf16=True,
            batch_fn=images,
        )
    for stage in (0, 2, 3):  # timm's --channels-last: the weights in that layout too
        out[f"cnn_channels_last_z{stage}"] = lambda r, s=stage: run_case(
            r, scratch, f"cnn_channels_last_z{s}", channels_last_cnn, s, batch_fn=images
        )
    for stage in (2, 3):
        out[f"cnn_resume_z{stage}"] = lambda r, s=stage: resume_case(
            r, scratch, f"cnn_resume_z{s}", s
        )
    out["vit_z0"] = lambda r: run_case(r, scratch, "vit_z0", ViT, 0, batch_fn=images)
    for stage in (2, 3):
        out[f"vit_bf16_z{stage}"] = lambda r, s=stage: run_case(
            r, scratch, f"vit_bf16_z{s}", ViT, s, bf16=True, batch_fn=images
        )
        out[f"unet_z{stage}"] = lambda r, s=stage: run_case(
            r, scratch, f"unet_z{s}", UNet, s, batch_fn=unet_batch
        )
    for stage in (1, 2, 3):
        out[f"odd_z{stage}"] = lambda r, s=stage: run_case(
            r, scratch, f"odd_z{s}", Odd, s, batch_fn=odd_batch
        )
    for stage in (1, 3):
        out[f"empty_z{stage}"] = lambda r, s=stage: run_case(
            r, scratch, f"empty_z{s}", lambda: Odd(empty=True), s, batch_fn=odd_batch
        )
        out[f"scalar_z{stage}"] = lambda r, s=stage: run_case(
            r, scratch, f"scalar_z{s}", lambda: Odd(scalar=True), s, batch_fn=odd_batch
        )
    for stage in (0, 2, 3):
        out[f"unseeded_z{stage}"] = lambda r, s=stage: run_case(
            r, scratch, f"unseeded_z{s}", CNN, s, seed=None, batch_fn=images
        )
    for stage in (0, 1, 3):
        out[f"unseeded_odd_z{stage}"] = lambda r, s=stage: run_case(
            r, scratch, f"unseeded_odd_z{s}", Odd, s, seed=None, batch_fn=odd_batch
        )
    return out


def run_all(scratch):
    """Each case's result; one that raised keeps what it had and the error (its type and first
    line) in the phase it was in."""
    results = {}
    for name, case in cases(scratch).items():
        results[name] = {}
        try:
            case(results[name])
        except Exception as e:  # a refusal is a recorded answer
            results[name]["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return results


def main(scratch):
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")  # accelerate on a CPU-only host (record_ds_accelerate.py)
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    return run_all(scratch)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ds_fixture import record

    scratch = Path(os.environ.get("VISION_SCRATCH", tempfile.gettempdir())) / "ds_vision"
    record(main(scratch), FIXTURE, scratch=scratch)
