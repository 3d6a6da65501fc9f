"""Hugging Face models that DeepSpeed 0.19.8's ZeRO-3 cannot build, trained by minispeed's.

Under `zero.Init` (what `from_pretrained` uses once an `HfDeepSpeedConfig` is alive) DeepSpeed
0.19.8 fails on two model families on the CPU, 2 gloo ranks (tried with transformers 5.24):

- `CLIPModel`: its `logit_scale` is a 0-dim parameter, and partitioning it raises
  "self.dim() cannot be 0 to view Float as Byte";
- `WhisperForConditionalGeneration`: its encoder's sinusoidal position table is built by a
  function `zero.Init` wraps, and the wrapped call loses an argument
  ("sinusoids() missing 1 required positional argument: 'channels'").

minispeed builds both partitioned, loads the checkpoint into the shards and trains them. With
no DeepSpeed reference to record, each is compared with plain PyTorch on one process: AdamW on
the mean of the two ranks' losses (the data-parallel gradient), step for step (the first loss
equal, then within 1e-4).
"""

from __future__ import annotations

import pytest
import torch

from minispeed.core.testing import run_distributed

transformers = pytest.importorskip("transformers")

STEPS, MICRO, LR = 3, 2, 1e-3
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 1000,
}


def _model(family: str):
    hf = transformers
    torch.manual_seed(0)
    if family == "clip":
        return hf.CLIPModel(
            hf.CLIPConfig(
                text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=16),
                vision_config=dict(image_size=16, patch_size=4, hidden_size=32,
                                   intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4),
                projection_dim=16,
            )
        )  # fmt: skip
    return hf.WhisperForConditionalGeneration(
        hf.WhisperConfig(
            vocab_size=64, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, d_model=32,
            encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
            max_target_positions=16, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2,
            bos_token_id=1, dropout=0.0,
        )
    )  # fmt: skip


def _batch(family: str, step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    if family == "clip":
        return {
            "pixel_values": torch.randn(MICRO, 3, 16, 16, generator=g),
            "input_ids": torch.randint(3, 64, (MICRO, 8), generator=g),
            "return_loss": True,
        }
    return {
        "input_features": torch.randn(MICRO, 8, 32, generator=g),
        "labels": torch.randint(3, 64, (MICRO, 6), generator=g),
    }


def _zero3(rank: int, world_size: int, family: str, path: str) -> list[float]:
    from transformers.integrations import HfDeepSpeedConfig

    import minispeed.comm as comm
    import minispeed.engine as deepspeed

    keep = HfDeepSpeedConfig(CONFIG)  # noqa: F841 (from_pretrained builds under zero.Init while it lives)
    cls = (
        transformers.CLIPModel if family == "clip" else transformers.WhisperForConditionalGeneration
    )
    model = cls.from_pretrained(path)
    engine, *_ = deepspeed.initialize(model=model, config=CONFIG)
    losses = []
    for step in range(STEPS):
        loss = engine(**_batch(family, step, rank)).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        comm.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses


def _plain(family: str, path: str) -> list[float]:
    cls = (
        transformers.CLIPModel if family == "clip" else transformers.WhisperForConditionalGeneration
    )
    model = cls.from_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        loss = sum(model(**_batch(family, step, r)).loss for r in range(2)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["clip", "whisper"])
def test_models_deepspeed_cannot_partition_train_as_plain_pytorch(family: str, tmp_path) -> None:
    _model(family).save_pretrained(tmp_path)
    want = _plain(family, str(tmp_path))
    for got in run_distributed(_zero3, world_size=2, args=(family, str(tmp_path)), timeout_s=180):
        # the gradients are summed in another order; Adam's first steps turn the last bits of
        # near-zero gradients into updates of up to lr, hence 1e-4 and not bit equality
        assert got[0] == pytest.approx(want[0], rel=1e-6), (family, got, want)
        assert got == pytest.approx(want, rel=1e-4), (family, got, want)
