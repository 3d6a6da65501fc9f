"""minispeed.compression against statements written out by hand: the quantizers' levels and
their straight-through gradient, the top-k mask, `clean` keeping the function while removing
pruned rows and heads, and the config's refusals naming the key and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from minispeed import compression
from minispeed.core.config import ConfigError


def test_fake_quantization_levels_and_straight_through_gradient():
    x = torch.tensor([-1.0, -0.5, 0.25, 1.0], requires_grad=True)
    # 3 bits symmetric: scale 2·1/8 = 0.25, levels -4..3 (1.0 clamps to 0.75)
    q = compression.fake_quantize(x, bits=3, symmetric=True)
    torch.testing.assert_close(q, torch.tensor([-1.0, -0.5, 0.25, 0.75]))
    q.backward(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    torch.testing.assert_close(x.grad, torch.tensor([1.0, 2.0, 3.0, 4.0]))  # STE: identity
    # 3 bits asymmetric on [0, 3]: scale 3/8, zero point 0, x/scale = 0, 8/3, 16/3, 8 -> 0,3,5,7
    y = torch.tensor([0.0, 1.0, 2.0, 3.0])
    q = compression.fake_quantize(y, bits=3, symmetric=False)
    torch.testing.assert_close(q, torch.tensor([0.0, 3.0, 5.0, 7.0]) * 0.375)
    # two groups, each its own scale: the small group keeps its resolution
    z = torch.tensor([[100.0, -100.0], [0.01, -0.02]])
    q = compression.quantize_reference(z, bits=8, groups=2)
    torch.testing.assert_close(q[1], z[1], atol=1e-4, rtol=0)


def test_top_k_mask_keeps_the_ceiling_and_passes_gradients():
    scores = torch.tensor([0.3, -1.0, 2.0, 0.1, 0.5], requires_grad=True)
    mask = compression.top_k_mask(scores, 0.5)  # ceil(2.5) = 3 kept
    torch.testing.assert_close(mask, torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0]))
    mask.sum().backward()
    torch.testing.assert_close(scores.grad, torch.ones(5))


class _Block(nn.Module):
    """Attention-shaped projections (2 heads of 4) and an MLP, enough for row and head pruning."""

    def __init__(self):
        super().__init__()
        self.q, self.v, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        heads = self.v.out_features // 4
        mix = (self.q(x).view(-1, heads, 4).softmax(-1) * self.v(x).view(-1, heads, 4)).flatten(1)
        return self.fc2(torch.relu(self.fc1(self.o(mix))))


def _section(offset=0):
    shared = {"enabled": True, "schedule_offset": offset}
    return {
        "row_pruning": {
            "shared_parameters": {**shared, "method": "l1"},
            "different_groups": {"rp": {"params": {"dense_ratio": 0.25}, "modules": ["fc1"],
                                        "related_modules": [["fc2"]]}},
        },
        "head_pruning": {
            "shared_parameters": {**shared, "method": "topk", "num_heads": 2},
            "different_groups": {"hp": {"params": {"dense_ratio": 0.5}, "modules": ["^o$"],
                                        "related_modules": [["^q$", "^v$"]]}},
        },
    }  # fmt: skip


def test_clean_removes_pruned_rows_and_heads_and_keeps_the_function():
    torch.manual_seed(0)
    model = _Block()
    cfg = compression.CompressionConfig.from_ds_config(_section(offset=1))
    compression.compress(model, cfg)
    schedule = compression.Schedule(model, cfg)
    x = torch.randn(3, 8)
    dense = model(x)
    schedule.step()  # step 1: both techniques on
    masked = model(x)
    assert not torch.allclose(dense, masked)
    before = sum(p.numel() for p in model.parameters())
    compression.clean(model, cfg)
    torch.testing.assert_close(model(x), masked)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["fc1.weight"] == (4, 8) and shapes["fc2.weight"] == (8, 4)
    assert shapes["o.weight"] == (8, 4) and shapes["q.weight"] == shapes["v.weight"] == (4, 8)
    # rows: 12 x (8 in + 1 bias + 8 of fc2's inputs); heads: 4 x (8 of o + 2 x (8 + 1));
    # and the 2 head scores
    assert before - sum(p.numel() for p in model.parameters()) == 12 * 17 + 4 * 26 + 2


@pytest.mark.parametrize(
    "section, path",
    [
        ({"weight_quantization": {"shared_parameters": {"enabled": True},
                                  "different_groups": {}}},
         "compression_training.weight_quantization.shared_parameters.quantize_weight_in_forward"),
        ({"channel_pruning": {"shared_parameters": {"enabled": True}}},
         "compression_training.channel_pruning.different_groups"),
        ({"sparse_pruning": {"shared_parameters": {"enabled": True, "method": "l1"},
                             "different_groups": {"g": {"params": {"dense_ratio": 1.5}}}}},
         "compression_training.sparse_pruning.different_groups.g.params.dense_ratio"),
        ({"row_pruning": {"shared_parmeters": {}}}, "compression_training.row_pruning"),
    ],
)  # fmt: skip
def test_bad_sections_are_refused_naming_the_key(section, path):
    with pytest.raises(ConfigError) as e:
        compression.CompressionConfig.from_ds_config(section)
    assert str(e.value).startswith(f"{path}") and e.value.path.startswith(path)


def test_a_schedule_over_an_uncompressed_model_names_the_missing_call():
    cfg = compression.CompressionConfig.from_ds_config(_section())
    with pytest.raises(ValueError, match="init_compression"):
        compression.Schedule(_Block(), cfg)


def test_channel_pruning_keeps_the_largest_kernels_and_clean_removes_the_rest():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 1), nn.BatchNorm2d(4), nn.Conv2d(4, 3, 1)).eval()
    with torch.no_grad():  # kernels' L1 norms 2, 4, 8, 6: l1 at 0.5 keeps channels 2 and 3
        model[0].weight.copy_(
            torch.tensor([1.0, 2.0, 4.0, 3.0]).view(4, 1, 1, 1).expand(4, 2, 1, 1)
        )
    section = {"channel_pruning": {
        "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 0},
        "different_groups": {"cp": {"params": {"dense_ratio": 0.5}, "modules": ["^0$"],
                                    "related_modules": [["^1$", "^2$"]]}}}}  # fmt: skip
    cfg = compression.CompressionConfig.from_ds_config(section)
    compression.compress(model, cfg)
    compression.Schedule(model, cfg)
    assert model[0].mask().view(-1).tolist() == [0.0, 0.0, 1.0, 1.0]
    x = torch.randn(2, 2, 3, 3)
    masked = model(x)
    compression.clean(model, cfg)
    torch.testing.assert_close(model(x), masked)
    assert model[0].weight.shape == (2, 2, 1, 1) and model[2].weight.shape == (3, 2, 1, 1)
    assert model[1].running_mean.shape == (2,) and model[1].num_features == 2
